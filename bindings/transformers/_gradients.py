"""Sum the gradients of the parameters every rank holds a copy of.

Under context parallelism each rank's loss is its share of the global mean
(``shard_batch``'s ``num_items_in_batch``), so the global gradient of a
replicated parameter is the sum, not the mean, of the ranks' gradients.
Expert-parallel parameters (marked ``EXPERT_PARALLEL`` by
``expert_parallel``) live on one rank only and are left out of that sum;
under a placement with replicas, each replica's gradient is replaced by the
sum over its expert's replicas (``commlib.moe.sum_replica_gradients``), so
that replicas stay equal after an optimizer step. Gradients travel in flat
buffers, one allreduce per bucket of one dtype and device, as DDP does; the
replicas' sums in one exchange per distinct placement, every experts module
of that placement (usually all of them) in it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np
import torch

from commlib.moe import Placement, sum_replica_gradients

from ._experts import EXPERT_PARALLEL, expert_modules, placement_of

__all__ = ["allreduce_gradients"]

DEFAULT_BUCKET_BYTES = 25 * 2**20


def allreduce_gradients(model: torch.nn.Module, comm,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Replace the ``.grad`` of every replicated parameter of ``model`` by
    its sum over the ranks of ``comm`` (collective), and, in experts modules
    whose placement has replicas, each expert slot's by the sum over its
    logical expert's replicas. A parameter without a gradient on some ranks
    (unused there) gets a zero one first, so that every copy receives the
    same sum; one without a gradient anywhere keeps none."""
    replicated = [p for p in model.parameters()
                  if not getattr(p, EXPERT_PARALLEL, False)]
    replicas = _replica_parameters(model)
    summed = replicated + [p for group in replicas.values() for _, p in group]
    has_grad = np.array([p.grad is not None for p in summed], dtype=np.uint8)
    anywhere = comm.allreduce(has_grad, op="max")
    for parameter, present in zip(summed, anywhere):
        if present and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    for bucket in _buckets([p.grad for p in replicated if p.grad is not None], bucket_bytes):
        _allreduce_bucket(bucket, comm)
    for placement, group in replicas.items():
        grads = {name: p.grad for name, p in group if p.grad is not None}
        if grads:  # the same on every rank: presence was agreed above
            for name, total in sum_replica_gradients(comm, grads, placement).items():
                grads[name].copy_(total)


def _replica_parameters(model: torch.nn.Module) -> Dict[Placement, List[Tuple[str, torch.Tensor]]]:
    """The expert parameters of the experts modules whose placement has
    replicas, by placement (in model order): one exchange sums them all."""
    grouped: Dict[Placement, List[Tuple[str, torch.Tensor]]] = defaultdict(list)
    for module_name, module in expert_modules(model):
        placement = placement_of(module)
        if placement is not None and (placement.replica_counts > 1).any():
            grouped[placement] += [(f"{module_name}.{name}", p)
                                   for name, p in module.named_parameters(recurse=False)
                                   if getattr(p, EXPERT_PARALLEL, False)]
    return grouped


def _buckets(grads: List[torch.Tensor], bucket_bytes: int) -> List[List[torch.Tensor]]:
    """The gradients in order, grouped by dtype and device, cut into buckets
    of at most ``bucket_bytes`` (a larger gradient is a bucket of its own)."""
    open_buckets: Dict[Tuple[torch.dtype, torch.device], Tuple[List[torch.Tensor], int]] = {}
    done: List[List[torch.Tensor]] = []
    for grad in grads:
        key = (grad.dtype, grad.device)
        bucket, filled = open_buckets.get(key, ([], 0))
        if bucket and filled + grad.nbytes > bucket_bytes:
            done.append(bucket)
            bucket, filled = [], 0
        bucket.append(grad)
        open_buckets[key] = (bucket, filled + grad.nbytes)
    return done + [bucket for bucket, _ in open_buckets.values()]


def _allreduce_bucket(grads: List[torch.Tensor], comm) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    summed = comm.allreduce(flat)
    for grad, part in zip(grads, summed.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))
