"""Predict the all-to-all traffic of one MoE dispatch before owning the
machines: ``commlib simulate`` (or ``python -m commlib.tools.simulate``).

No MPI: every GPU's routing is generated here, exactly as ``commlib diag moe``
generates it on that rank (``synthetic_routing``, shared by both), and the
payload bytes are counted exactly as ``Dispatcher`` sends them:

- flat: a token goes once to each rank that owns one of its experts;
- two-hop: once to each destination node, to the rank there with the
  sender's local rank (the forwarder), which sends it once to each owner on
  its node.

Traffic is payload rows x hidden x itemsize; a rank's copy to itself is not
traffic, and the 8k bytes of routing metadata per row are not counted (as in
``DispatchStats``). So the bytes predicted here are the bytes ``diag moe``
measures on the same configuration and seed.

Time model, per dispatch: every GPU sends its inter-node bytes at
``--inter-bw`` and its intra-node bytes at ``--intra-bw``, one after the
other, and the dispatch takes as long as the slowest GPU:
``max over GPUs (inter sent / inter-bw + intra sent / intra-bw)``. It ignores
latency, receive-side contention and overlap of the two links, so read it as
a comparison between schemes, not a promise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import click
import ml_dtypes
import numpy as np

from commlib.moe import route

# the element types a token row may have on the wire
DTYPES = ("float32", "float16", "bfloat16", "float64")
# one routing score for the synthetic router, the DeepSeek-V2 / Mixtral one
SCORE = "softmax"
_GB = 1e9


# -- the routing diag moe runs, rank by rank -----------------------------------
def skew_bias(experts: int, skew: float) -> np.ndarray:
    """Popularity added to every token's logits: ``-skew * log(1 + e)`` for
    expert e. Under the softmax score this multiplies expert e's affinity by
    ``(1 + e) ** -skew``, a Zipf-like preference for low ids, the shape of
    the hot experts seen in real MoE traces; 0 is uniform."""
    return (-skew * np.log1p(np.arange(experts))).astype(np.float32)


def synthetic_routing(rank: int, tokens: int, experts: int, topk: int, skew: float,
                      seed: int, num_groups: Optional[int] = None,
                      topk_groups: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(experts, weights) [tokens, topk] of rank ``rank``: standard normal
    logits from ``default_rng([seed, rank])`` plus ``skew_bias``, through
    ``commlib.moe.route`` with the softmax score. A pure function of its
    arguments, so ``diag moe`` and ``simulate`` route identically."""
    rng = np.random.default_rng([seed, rank])
    logits = rng.standard_normal((tokens, experts), dtype=np.float32) + skew_bias(experts, skew)
    return route(logits, topk, score=SCORE, num_groups=num_groups, topk_groups=topk_groups)


def zipf_popularity(experts: int, exponent: float, seed: int) -> np.ndarray:
    """Expert popularity Zipf-distributed with ``exponent`` (the i-th most
    popular expert ``i ** -exponent``), shuffled over the ids by
    ``default_rng(seed)``, as measured routing often is: a function of its
    arguments, so every rank draws the same."""
    return np.random.default_rng(seed).permutation(1.0 / np.arange(1, experts + 1) ** exponent)


def popularity_routing(rank: int, tokens: int, popularity: np.ndarray, topk: int, seed: int,
                       num_groups: Optional[int] = None,
                       topk_groups: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(experts, weights) [tokens, topk] of rank ``rank``: each token draws
    its top-k without replacement, each draw in proportion to
    ``popularity`` (one non-negative value per expert, not all 0): logits of
    log popularity plus Gumbel noise from ``default_rng([seed, rank, 2])``
    (the Gumbel top-k trick) through ``commlib.moe.route`` with the softmax
    score. An expert of popularity 0 (floored at 1e-30 of the largest, as
    logits must be finite) is never drawn while one of at least 1e-12 of the
    largest is left: their logits lie further apart than Gumbel noise of
    doubles reaches. With k > 1 the load is flatter than the popularity, a
    token taking an expert at most once."""
    popularity = np.asarray(popularity, dtype=np.float64)
    rng = np.random.default_rng([seed, rank, 2])
    floor = np.log(np.maximum(popularity, popularity.max() * 1e-30))
    logits = floor + rng.gumbel(size=(tokens, popularity.size))
    return route(logits.astype(np.float32), topk, score=SCORE, num_groups=num_groups,
                 topk_groups=topk_groups)


def parse_dtype(name: str) -> np.dtype:
    """A row element type by name; bfloat16 comes from ml_dtypes."""
    return np.dtype(getattr(ml_dtypes, name, name))


# -- exact byte counts ------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """GPUs in nodes of ``gpus_per_node`` consecutive ranks (block placement,
    what COMMLIB_RANKS_PER_NODE emulates), experts spread E/P per rank."""

    nodes: int
    gpus_per_node: int
    experts: int

    @property
    def size(self) -> int:
        return self.nodes * self.gpus_per_node

    def owner(self, expert_ids: np.ndarray) -> np.ndarray:
        """Rank holding each expert id."""
        return expert_ids // (self.experts // self.size)

    def node_of(self, ranks: np.ndarray) -> np.ndarray:
        return ranks // self.gpus_per_node

    def forwarder(self, source: int, owners: np.ndarray) -> np.ndarray:
        """The rank on each owner's node with ``source``'s local rank: where a
        two-hop dispatch from ``source`` first lands."""
        return self.node_of(owners) * self.gpus_per_node + source % self.gpus_per_node


def copies_per_rank(destinations: np.ndarray, size: int) -> np.ndarray:
    """[size]: how many tokens go to each rank, given each token's k
    destination ranks [T, k]; a token counts once per rank however many of
    its experts live there (the deduplication)."""
    wanted = np.zeros((destinations.shape[0], size), dtype=bool)
    wanted[np.arange(destinations.shape[0])[:, None], destinations] = True
    return wanted.sum(axis=0)


def rows_sent(source: int, expert_ids: np.ndarray, layout: Layout,
              hierarchical: bool) -> np.ndarray:
    """[P, P]: payload rows each rank sends on account of ``source``'s
    tokens. Two-hop: the copy that reaches owner o went through o's node's
    forwarder for ``source``, so the first hop counts once per node and the
    second once per owner, sent by that forwarder."""
    rows = np.zeros((layout.size, layout.size), dtype=np.int64)
    owners = layout.owner(expert_ids)
    per_owner = copies_per_rank(owners, layout.size)
    if not hierarchical:
        rows[source] = per_owner
        return rows
    ranks = np.arange(layout.size)
    forwarders = layout.forwarder(source, ranks)
    rows[source] = copies_per_rank(forwarders[owners], layout.size)
    np.add.at(rows, (forwarders, ranks), per_owner)
    return rows


@dataclass(frozen=True)
class Prediction:
    """One scheme's dispatch: bytes over and inside nodes (totals over GPUs
    and what each GPU sends) and the modelled time."""

    inter_node_bytes: int
    intra_node_bytes: int
    inter_per_gpu: List[int]
    intra_per_gpu: List[int]
    predicted_seconds: float

    def to_json(self) -> Dict[str, object]:
        return {"inter_node_bytes": self.inter_node_bytes,
                "intra_node_bytes": self.intra_node_bytes,
                "per_gpu": {"inter_node_bytes": self.inter_per_gpu,
                            "intra_node_bytes": self.intra_per_gpu},
                "predicted_seconds": self.predicted_seconds}


def predict(traffic: np.ndarray, layout: Layout, intra_bw: float, inter_bw: float) -> Prediction:
    """Split a [P, P] byte matrix by node and apply the time model."""
    nodes = layout.node_of(np.arange(layout.size))
    across = nodes[:, None] != nodes[None, :]
    inside = ~across & ~np.eye(layout.size, dtype=bool)
    inter = (traffic * across).sum(axis=1)
    intra = (traffic * inside).sum(axis=1)
    seconds = float(np.max(inter / (inter_bw * _GB) + intra / (intra_bw * _GB)))
    return Prediction(int(inter.sum()), int(intra.sum()), inter.tolist(), intra.tolist(), seconds)


# -- the command ------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """The options that decide the routing and the bytes."""

    layout: Layout
    topk: int
    tokens: int
    row_bytes: int
    skew: float
    seed: int

    def traffic(self, topk_groups: Optional[int], hierarchical: bool) -> np.ndarray:
        """[P, P] bytes of one dispatch under this routing and path."""
        groups = None if topk_groups is None else self.layout.nodes
        rows = sum(rows_sent(rank, synthetic_routing(rank, self.tokens, self.layout.experts,
                                                     self.topk, self.skew, self.seed, groups,
                                                     topk_groups)[0], self.layout, hierarchical)
                   for rank in range(self.layout.size))
        return rows * self.row_bytes


def tightest_topk_groups(experts: int, nodes: int, topk: int) -> int:
    """The fewest nodes a token can be limited to: its k experts must fit."""
    return -(-topk // (experts // nodes))


def check_usage(nodes: int, gpus_per_node: int, experts: int, topk: int,
                topk_groups: Optional[int]) -> None:
    """Reject impossible layouts and routings as usage errors (exit 2), with
    what to change, before any work."""
    size = nodes * gpus_per_node
    if experts % size:
        raise click.BadParameter(f"{experts} experts cannot be spread evenly over {size} GPUs "
                                 f"({nodes} nodes x {gpus_per_node}); use a multiple of {size}",
                                 param_hint="'--experts'")
    if topk > experts:
        raise click.BadParameter(f"top-{topk} is impossible with {experts} experts; use at most "
                                 f"{experts}", param_hint="'--topk'")
    if topk_groups is None:
        return
    if topk_groups > nodes:
        raise click.BadParameter(f"{topk_groups} exceeds the {nodes} nodes (one expert group "
                                 f"per node); use 1..{nodes}", param_hint="'--topk-groups'")
    least = tightest_topk_groups(experts, nodes, topk)
    if topk_groups < least:
        raise click.BadParameter(f"top-{topk} does not fit in {topk_groups} node(s) of "
                                 f"{experts // nodes} experts; use at least {least}",
                                 param_hint="'--topk-groups'")


def schemes(config: Config, topk_groups: int, bandwidths: Tuple[float, float]
            ) -> Dict[str, Prediction]:
    """flat (top-k, one hop), node_limited (at most ``topk_groups`` nodes per
    token, one hop) and two_hop (node-limited, crossing to each node once)."""
    layout = config.layout
    return {name: predict(config.traffic(groups, hierarchical), layout, *bandwidths)
            for name, groups, hierarchical in (("flat", None, False),
                                               ("node_limited", topk_groups, False),
                                               ("two_hop", topk_groups, True))}


def report_lines(config: Config, chosen: str, results: Dict[str, Prediction],
                 bandwidths: Tuple[float, float]) -> List[str]:
    """A table, one line per scheme, the one matching the flags marked,
    under the (intra, inter) GB/s its times assume."""
    layout = config.layout
    tokens = config.tokens * layout.size
    lines = [f"# commlib simulate: {layout.nodes} nodes x {layout.gpus_per_node} GPUs, "
             f"{layout.experts} experts, top-{config.topk}, {config.tokens} tokens/GPU, "
             f"{config.row_bytes} B/row",
             f"# time: the slowest GPU's inter-node bytes at {bandwidths[1]:g} GB/s plus its "
             f"intra-node bytes at {bandwidths[0]:g} GB/s",
             f"# {'scheme':<14} {'inter-node B':>14} {'intra-node B':>14} "
             f"{'B/token':>10} {'max inter/GPU':>14} {'time (ms)':>10}"]
    for name, result in results.items():
        per_token = (result.inter_node_bytes + result.intra_node_bytes) / tokens
        mark = " <" if name == chosen else ""
        lines.append(f"  {name:<14} {result.inter_node_bytes:>14} {result.intra_node_bytes:>14} "
                     f"{per_token:>10.1f} {max(result.inter_per_gpu):>14} "
                     f"{result.predicted_seconds * 1e3:>10.3f}{mark}")
    return lines


@click.command("simulate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--nodes", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--experts", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--topk", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--topk-groups", type=click.IntRange(min=1), default=None,
              help="Nodes a token may use (group-limited routing, one group per node). "
                   "Default: plain top-k; the node-limited schemes then use the fewest "
                   "nodes the top-k fits in.")
@click.option("--hierarchical", is_flag=True,
              help="The reported scheme dispatches in two hops (all three are computed).")
@click.option("--tokens", type=click.IntRange(min=0), default=4096, show_default=True,
              help="Tokens per GPU.")
@click.option("--hidden", type=click.IntRange(min=1), default=7168, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True)
@click.option("--skew", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Popularity bias: logits + -skew*log(1+expert id).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--intra-bw", type=click.FloatRange(min=0, min_open=True), default=160.0,
              show_default=True, help="GB/s each GPU sends inside its node.")
@click.option("--inter-bw", type=click.FloatRange(min=0, min_open=True), default=50.0,
              show_default=True, help="GB/s each GPU sends to other nodes (300 Mbit/s is 0.0375).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Also write the prediction as JSON to this file.")
def simulate(nodes: int, gpus_per_node: int, experts: int, topk: int,
             topk_groups: Optional[int], hierarchical: bool, tokens: int, hidden: int,
             dtype: str, skew: float, seed: int, intra_bw: float, inter_bw: float,
             json_path: Optional[str]) -> None:
    """Predict one dispatch's inter- and intra-node bytes and time for flat,
    node-limited and node-limited two-hop dispatch, from the same seeded
    routing `commlib diag moe` uses. Top-level JSON keys describe the scheme
    the flags select (--topk-groups, --hierarchical)."""
    check_usage(nodes, gpus_per_node, experts, topk, topk_groups)
    layout = Layout(nodes, gpus_per_node, experts)
    config = Config(layout, topk, tokens, hidden * parse_dtype(dtype).itemsize, skew, seed)
    limit = topk_groups or tightest_topk_groups(experts, nodes, topk)
    results = schemes(config, limit, (intra_bw, inter_bw))
    chosen = _chosen_scheme(topk_groups, hierarchical)
    if chosen not in results:
        results[chosen] = predict(config.traffic(topk_groups, hierarchical), layout,
                                  intra_bw, inter_bw)
    click.echo("\n".join(report_lines(config, chosen, results, (intra_bw, inter_bw))))
    if json_path:
        _write_json(json_path, chosen, results, dict(
            nodes=nodes, gpus_per_node=gpus_per_node, experts=experts, topk=topk,
            topk_groups=topk_groups, node_limited_topk_groups=limit, hierarchical=hierarchical,
            tokens=tokens, hidden=hidden, dtype=dtype, skew=skew, seed=seed, score=SCORE,
            intra_bw=intra_bw, inter_bw=inter_bw))


def _chosen_scheme(topk_groups: Optional[int], hierarchical: bool) -> str:
    """The scheme the flags describe; plain top-k over two hops is not one
    of the three compared, so it gets its own name."""
    if topk_groups is None:
        return "flat_two_hop" if hierarchical else "flat"
    return "two_hop" if hierarchical else "node_limited"


def _write_json(path: str, chosen: str, results: Dict[str, Prediction],
                config: Dict[str, object]) -> None:
    """The chosen scheme's numbers at top level, every scheme by name."""
    document = dict(results[chosen].to_json(), scheme=chosen, config=config,
                    **{name: result.to_json() for name, result in results.items()})
    with open(path, "w") as handle:
        json.dump(document, handle, indent=2)


if __name__ == "__main__":
    simulate()
