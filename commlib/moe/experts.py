"""Where a Dispatcher's experts live, and what every dispatch path reads of
it: the options every rank agreed on, each hop's destination map, the
capacity rule, the slots of a placement, and the small tables kept beside
the data on each device. Also the plan of a routed dispatch (``DispatchPlan``): the
capacity and hop 1's copies, worked out on the device before anything
moves (the counted and the per-destination fixed paths start from it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import array_api_extra as xpx
import numpy as np

from ..namespace import bincount, device, float32, framework, from_bytes, index_dtype, namespace
from . import contract
from .hops import copy_keys, lookup
from .placement import Placement

__all__ = ["Experts", "DispatchPlan", "replica_slots"]


@dataclass
class DispatchPlan:
    """This rank's side of a dispatch, worked out on its device before
    anything moves; the host parts come from the dispatch's one copy (none
    under a fixed capacity)."""

    ids: Any                  # [T, k] expert ids after capacity (-1: none)
    gate: Any                 # [T, k] float32 weights
    keys: Any                 # hop 1: sorted destination * T + row, one per slot
    first: Any                # keys that start a (destination, row) copy
    dropped: Any              # [E] on the device: assignments over capacity (None: no cap)
    invalid: Any              # [1] on the device: ids outside [-1, E)
    extremes: Any             # [2] on the device: the smallest and largest id given


class Experts:
    """The experts of a ``Dispatcher`` over ``comm`` (its options, checked
    and agreed on by every rank first): slot p on rank
    ``p // local_experts``, logical expert e's slots those of
    ``placement`` (slot e without one). ``pipeline_chunks`` may change
    between dispatches (each dispatch agrees on it)."""

    def __init__(self, comm, num_experts: int, capacity_factor: Optional[float],
                 drop_policy: str, hierarchical: bool, max_tokens_per_rank: Optional[int],
                 pipeline_chunks: Optional[int], placement: Optional[Placement]):
        self.comm = comm
        self.num_experts = num_experts
        self.placement = placement
        self.num_slots = contract.slot_count(num_experts, placement)
        self.local_experts = self.num_slots // comm.size  # slots on each rank
        self.slot_experts = None if placement is None else placement.physical_to_logical
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.hierarchical = hierarchical
        self.max_tokens_per_rank = max_tokens_per_rank
        self.pipeline_chunks = pipeline_chunks
        self.hop_maps = self._destination_maps()
        self._on_device: Dict[tuple, Any] = {}

    def capacity(self, tokens: int, k: int) -> Optional[int]:
        """Assignments each expert takes from one rank."""
        return contract.capacity(tokens, k, self.num_experts, self.capacity_factor,
                                 self.max_tokens_per_rank)

    def capacity_losses(self, ids: Any, gate: Any) -> Optional[Any]:
        """[T, k]: the assignments beyond their expert's capacity from this
        rank (None without a capacity). A fixed capacity without a capacity
        factor has room for C = ``max_tokens_per_rank`` assignments of each
        expert from each rank (the low-latency layout's slots): only a token
        naming an expert more than once can need more, and the latest are
        dropped, in every layout alike. Fixed-size masks throughout."""
        cap, policy = self.capacity(*ids.shape), self.drop_policy
        if cap is None and self.max_tokens_per_rank is not None:
            cap, policy = self.max_tokens_per_rank, "position"
        if cap is None:
            return None
        xp = namespace(ids)
        flat = xp.reshape(ids, (-1,))
        # group by expert; within an expert the heaviest (probs) or the
        # earliest (position) first, ties to the earlier: two stable sorts
        if policy == "probs":
            by_weight = xp.argsort(-xp.reshape(gate, (-1,)), stable=True)
            order = xp.take(by_weight, xp.argsort(xp.take(flat, by_weight), stable=True))
        else:
            order = xp.argsort(flat, stable=True)
        grouped = xp.take(flat, order)
        rank_in_expert = xp.arange(grouped.shape[0], dtype=grouped.dtype,
                                   device=device(ids)) - xp.searchsorted(grouped, grouped)
        loses = (rank_in_expert >= cap) & (grouped >= 0)  # in sorted order
        lost = xpx.at(xp.zeros(flat.shape, dtype=xp.bool, device=device(ids)))[order].set(loses)
        return xp.reshape(lost, ids.shape)

    def plan(self, x: Any, experts: Any, weights: Any) -> DispatchPlan:
        """Capacity and hop 1's copies, on the device. Ids outside [-1, E)
        are treated as -1 here (counted in ``invalid``), so that no gather
        reads out of bounds before they are refused (or, under a fixed
        capacity, reported). Under a placement the capacity is applied to
        the logical ids, so the same assignments are dropped as without one,
        and then the kept ones become slots (``DispatchPlan.ids`` are slots)."""
        xp = namespace(x)
        kind, where = index_dtype(x), device(x)
        maps = self.device_maps(x)
        count = self.num_experts
        ids = xp.astype(experts, kind, copy=False)
        if math.prod(ids.shape):
            extremes = xp.reshape(xp.astype(xp.stack([xp.min(experts), xp.max(experts)]),
                                            kind), (2,))
        else:
            extremes = xp.full((2,), -1, dtype=kind, device=where)
        inside = (ids >= -1) & (ids < count)
        invalid = xp.reshape(xp.sum(xp.astype(~inside, kind)), (1,))
        ids = xp.where(inside, ids, -1)
        gate = float32(weights)
        lost = self.capacity_losses(ids, gate)
        if self.placement is not None:
            ids = self.slots_of(ids)
        dropped = None
        if lost is not None:
            dropped = bincount(xp.where(lost, ids, -1), self.num_slots)
            ids = xp.where(lost, -1, ids)
        keys, first = copy_keys(lookup(maps[0], ids))
        return DispatchPlan(ids, gate, keys, first, dropped, invalid, extremes)

    def slots_of(self, ids: Any) -> Any:
        """[T, k] logical ids -> the slots this rank sends them to
        (``replica_slots`` of this rank's replica table)."""
        table = self.beside(ids, ("replicas",), lambda put: put(
            np.array(self.placement.replica_table[self.comm.rank]).reshape(-1)))  # writable
        return replica_slots(ids, table, self.placement.columns)

    def _destination_maps(self) -> List[np.ndarray]:
        """Per hop, expert (slot) -> destination rank (host int64 [E]): the
        owner; for two hops first the owner's node's rank with this local
        rank."""
        owner = np.arange(self.num_slots) // self.local_experts
        if not self.hierarchical:
            return [owner]
        topology = self.comm.topology
        local = topology.local_rank
        forwarder = np.array([topology.ranks_of(topology.node_of(r))[local]
                              for r in range(self.comm.size)])
        return [forwarder[owner], owner]

    def beside(self, like: Any, key: tuple, make: Callable[[Callable], Any]) -> Any:
        """``make(put)`` (host arrays, each ``put`` beside ``like`` in its
        index dtype) cached per framework, device and ``key``: copied to
        each device once, not once per dispatch (a copy from host memory can
        make the host wait, and a CUDA graph cannot capture it)."""
        full_key = (framework(like), str(device(like)), str(index_dtype(like))) + key
        if full_key not in self._on_device:
            xp = namespace(like)
            self._on_device[full_key] = make(
                lambda host: xp.asarray(host, dtype=index_dtype(like), device=device(like)))
        return self._on_device[full_key]

    def blank(self, like: Any, k: int) -> Any:
        """An empty slot's routing metadata as bytes beside ``like``: ids -1,
        weights 0 (made once per device, not per dispatch)."""
        key = (framework(like), str(device(like)), "blank", k)
        if key not in self._on_device:
            xp = namespace(like)
            host = np.concatenate([np.full((1, k), -1.0, np.float32),
                                   np.zeros((1, k), np.float32)], axis=1)
            self._on_device[key] = xp.asarray(host.view(np.uint8), device=device(like))
        return self._on_device[key]

    def device_maps(self, like: Any) -> List[Any]:
        """The hop maps beside ``like``."""
        return self.beside(like, ("maps",), lambda put: [put(m) for m in self.hop_maps])

    def served(self, message: Any, k: int, destination: Any) -> Any:
        """The expert ids of arrived rows [rows, k] that ``destination`` (a
        hop map) sends to this rank, -1 for the others: every copy of a
        token carries all its ids, and each rank keeps its own."""
        xp = namespace(message)
        ids = xp.astype(from_bytes(message[:, :4 * k], xp.float32, (k,)),
                        destination.dtype)
        return xp.where(lookup(destination, ids) == self.comm.rank, ids, -1)


def replica_slots(ids: Any, table: Any, columns: int) -> Any:
    """[T, k] logical ids -> the slots a sender sends them to: token t takes
    column ``t % columns`` of ``table`` (its row of
    ``Placement.replica_table``, flattened), -1 stays -1 (one gather). Fixed
    sizes: the JAX Dispatcher traces it under ``jax.jit``."""
    xp = namespace(ids)
    row = xp.arange(ids.shape[0], dtype=ids.dtype, device=device(ids))[:, None] % columns
    return lookup(table, xp.where(ids >= 0, ids * columns + row, -1))
