"""DeepSeek's published expert-placement algorithm (``eplb.py`` of
deepseek-ai/EPLB), re-implemented here in NumPy for one layer, as the
baseline commlib's ``rebalance`` is compared with. Written from reading
theirs: the same steps, the same tie-breaking (argmax and argmin take the
first), a stable sort where theirs is unspecified."""

import numpy as np


def balanced_packing(weights, packs):
    """Heaviest first onto the lightest pack with room, every pack getting
    len(weights) // packs items: [packs, items per pack], each pack's items in
    the order they arrived."""
    per_pack = len(weights) // packs
    totals, contents = [0.0] * packs, [[] for _ in range(packs)]
    for item in np.argsort(-np.asarray(weights), kind="stable"):
        pack = min((p for p in range(packs) if len(contents[p]) < per_pack),
                   key=totals.__getitem__)
        contents[pack].append(item)
        totals[pack] += weights[item]
    return np.array(contents)


def replicate_experts(weights, physical):
    """The replica count of each expert: each extra one to the expert with
    the largest load per replica."""
    count = np.ones(len(weights), dtype=np.int64)
    for _ in range(physical - len(weights)):
        count[np.argmax(weights / count)] += 1
    return count


def _pack_onto_gpus(weights, experts, physical, gpus):
    """Replicate ``experts`` into ``physical`` slots and pack onto ``gpus``
    GPUs: [gpus, physical // gpus] of expert ids."""
    count = replicate_experts(weights, physical)
    replicas = np.repeat(np.arange(len(weights)), count)
    return experts[replicas[balanced_packing((weights / count)[replicas], gpus)]]


def rebalance_experts(weights, physical, groups, nodes, gpus):
    """physical_to_logical [physical] for one layer: hierarchical when
    ``nodes`` divides ``groups`` (groups packed onto nodes, then replicas
    inside each node, its experts in the order their groups arrived, which
    decides ties), global otherwise."""
    weights = np.asarray(weights, dtype=np.float64)
    if groups % nodes:
        groups, nodes = 1, 1
    size = len(weights) // groups
    rows = []
    for node_groups in balanced_packing(weights.reshape(groups, size).sum(1), nodes):
        experts = (node_groups[:, None] * size + np.arange(size)).ravel()
        rows.append(_pack_onto_gpus(weights[experts], experts, physical // nodes, gpus // nodes))
    return np.concatenate(rows).ravel()


def imbalance(physical_to_logical, weights, gpus):
    """Busiest GPU over the mean GPU, each expert's load split evenly over
    its replicas."""
    count = np.bincount(physical_to_logical, minlength=len(weights))
    loads = (np.asarray(weights, dtype=np.float64) / count)[physical_to_logical]
    loads = loads.reshape(gpus, -1).sum(1)
    return loads.max() / loads.mean()
