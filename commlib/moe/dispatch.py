"""MoE dispatch and combine: the variable-size all-to-all of expert
parallelism, deduplicated per destination rank, flat or two-hop.

Dispatch, per hop: a token goes to a destination rank once, however many of
its experts live there (DeepEP's layout: count tokens once per destination,
not once per token-expert pair), with a little metadata saying which of its
experts (and weights) that rank serves. The owner expands each arrival into
one row per local expert: ``expert_x``, grouped by local expert.

Combine mirrors it: each owner sums a token's weighted expert outputs
locally, so a token's result travels back once per rank it visited, and the
sender adds up what comes back.

Flat: one hop, straight to the owners. Two-hop (``hierarchical``): a token
first crosses to each destination node once, to the rank there with the
sender's local rank, which forwards it inside the node to the owners; on the
way back the forwarder sums inside the node before the one crossing back.

Capacity: each expert takes at most ``ceil(T * k / E * capacity_factor)``
assignments from each source rank; the rest are dropped (by lowest weight or
latest position), contribute nothing, and are counted.

Everything runs in the caller's framework, on its device (torch ops for torch
tensors, ``jax.numpy`` for JAX arrays, NumPy for NumPy): permutations,
metadata, expansion and sums. Only the rows cross into the transport, in
their own dtype (bfloat16 stays bfloat16 on the wire); weights and sums are
float32; counts go to the host, where the transport needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

from ..namespace import (
    counts,
    device,
    dtype_name,
    float32,
    framework,
    framework_of,
    index_dtype,
    namespace,
    scatter_add,
    to_host,
)
from .stats import DispatchStats

DROP_POLICIES = ("probs", "position")
# expert ids travel as float32 beside the weights (one metadata message);
# float32 holds every integer below 2**24 exactly
MAX_EXPERTS = 2 ** 24


@dataclass
class _Hop:
    """One all-to-all hop: the source rows sent (rank-major) and the counts."""

    send_rows: Any           # caller's framework: source row of each sent row, in send order
    send_counts: np.ndarray  # host int64 [P]
    recv_counts: np.ndarray  # host int64 [P]
    sources: int             # rows on the sending side


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch, and what the dispatch saw.

    ``tokens_per_expert[e]`` (host int64): rows of ``expert_x`` for this
    rank's local expert e. ``stats``: the global picture of this dispatch.
    The index arrays are in the caller's framework, on its device."""

    tokens_per_expert: np.ndarray
    stats: DispatchStats
    hops: List[_Hop] = field(repr=False)
    arrival_rows: Any = field(repr=False)     # received row of each expert_x row
    arrival_slots: Any = field(repr=False)    # which of the token's k slots it is
    arrival_weights: Any = field(repr=False)  # its routing weight (float32)
    received_rows: int = field(repr=False)


def _require_one_place(named: List[Tuple[str, Any]]) -> None:
    """Raise ValueError unless the arrays are of one framework, on one
    device: commlib computes where the data lives and never moves it."""
    places = [(framework(a), str(device(a))) for _, a in named]
    if len(set(places)) > 1:
        found = ", ".join(f"{name} {kind} on {where}" for (name, _), (kind, where)
                          in zip(named, places))
        raise ValueError(f"{found}: pass arrays of one framework on one device "
                         f"(convert the odd one out first)")


class Dispatcher:
    """Expert-parallel dispatch and combine over ``comm``: expert e of
    ``num_experts`` lives on rank ``e // (num_experts // comm.size)``."""

    def __init__(self, comm, num_experts: int, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False):
        problem = None
        try:
            if isinstance(num_experts, bool) or not isinstance(num_experts, int) \
                    or num_experts < 1 or num_experts % comm.size:
                raise ValueError(f"num_experts={num_experts!r} must be a positive multiple of "
                                 f"the world size {comm.size} (expert e lives on rank "
                                 f"e // (num_experts // size))")
            if num_experts > MAX_EXPERTS:
                raise ValueError(f"num_experts={num_experts} exceeds {MAX_EXPERTS}, the most "
                                 f"whose ids travel exactly in the float32 routing metadata")
            if drop_policy not in DROP_POLICIES:
                raise ValueError(f"unknown drop_policy {drop_policy!r}; use one of "
                                 f"{', '.join(DROP_POLICIES)}")
            if capacity_factor is not None and not capacity_factor > 0:
                raise ValueError(f"capacity_factor must be positive (or None for no cap), "
                                 f"got {capacity_factor!r}")
            if hierarchical and not comm.topology.is_uniform:
                raise ValueError("two-hop dispatch needs the same number of ranks on every "
                                 "node")
        except ValueError as error:
            problem = error
        comm.agree("moe.Dispatcher", num_experts, capacity_factor, drop_policy, hierarchical,
                   problem=problem)
        self.comm = comm
        self.num_experts = num_experts
        self.local_experts = num_experts // comm.size
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.hierarchical = hierarchical
        self.stats = DispatchStats.zeros(num_experts, comm.size)
        self._hop_maps = self._destination_maps()

    # -- dispatch ---------------------------------------------------------------
    def dispatch(self, x: Any, experts: Any, weights: Any) -> Tuple[Any, DispatchHandle]:
        """Send each token's row to the ranks of its experts. ``x`` [T, H];
        ``experts`` [T, k] int (-1: no expert); ``weights`` [T, k]; all three
        of one framework, on one device. Returns ``expert_x`` [rows, H]
        grouped by local expert, in x's framework and dtype, and the handle
        for ``combine``."""
        problem = self._problem(x, experts, weights)
        facts = self._facts(x, experts) if problem is None else ()
        self.comm.agree("moe.dispatch", *facts, problem=problem)
        xp = namespace(x)
        ids = xp.astype(experts, index_dtype(x), copy=False)
        gate = float32(weights)
        ids, dropped = self._apply_capacity(ids, gate)
        requested = counts(ids, self.num_experts)
        rows, hops = x, []
        traffic = np.zeros((self.comm.size, self.comm.size), np.int64)
        row_bytes = x.itemsize * math.prod(x.shape[1:])
        for expert_to_rank in self._hop_maps:
            destination = xp.asarray(expert_to_rank, dtype=ids.dtype, device=device(x))
            hop, rows, ids, gate = self._hop(rows, ids, gate, destination)
            traffic[self.comm.rank] += hop.send_counts * row_bytes
            hops.append(hop)
        expert_x, arrival_rows, arrival_slots, arrival_weights, per_expert = \
            self._expand(rows, ids, gate)
        stats = DispatchStats.gather(self.comm, requested, dropped, traffic)
        self.stats = self.stats + stats
        handle = DispatchHandle(per_expert, stats, hops, arrival_rows, arrival_slots,
                                arrival_weights, int(rows.shape[0]))
        return expert_x, handle

    @staticmethod
    def _facts(x: Any, experts: Any) -> Tuple[str, ...]:
        """What every rank's dispatch must share."""
        return (f"k={experts.shape[-1] if experts.ndim == 2 else None}",
                f"row shape {tuple(x.shape[1:])}", f"dtype {dtype_name(x)}")

    def _problem(self, x: Any, experts: Any, weights: Any) -> Optional[Exception]:
        """What is wrong with this rank's input (None: nothing). Raised on
        every rank by ``agree``, so no rank is left waiting in a collective."""
        named = [("x", x), ("experts", experts), ("weights", weights)]
        try:
            for name, a in named:
                framework_of(name, a)
            _require_one_place(named)
            if x.ndim < 1:
                raise ValueError("x must have one row per token, got a scalar")
            tokens = x.shape[0]
            if experts.ndim != 2 or experts.shape[0] != tokens:
                raise ValueError(f"experts must be [tokens, k] with {tokens} rows like x, got "
                                 f"shape {tuple(experts.shape)}")
            if tuple(weights.shape) != tuple(experts.shape):
                raise ValueError(f"weights must have the shape of experts "
                                 f"{tuple(experts.shape)}, got {tuple(weights.shape)}")
            if not dtype_name(experts).startswith(("int", "uint")):
                raise ValueError(f"experts must be integers, got {dtype_name(experts)}")
            if math.prod(experts.shape):
                xp = namespace(experts)
                low, high = int(xp.min(experts)), int(xp.max(experts))
                if low < -1 or high >= self.num_experts:
                    raise ValueError(f"expert indices must lie in [-1, {self.num_experts}) "
                                     f"(-1: no expert), got values from {low} to {high}")
        except ValueError as error:
            return error
        return None

    def _capacity(self, tokens: int, k: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * k / self.num_experts * self.capacity_factor)

    def _apply_capacity(self, ids: Any, gate: Any) -> Tuple[Any, np.ndarray]:
        """Drop the assignments beyond each expert's capacity from this rank:
        returns (ids with dropped ones set to -1, dropped per expert)."""
        nothing = np.zeros(self.num_experts, np.int64)
        cap = self._capacity(*ids.shape)
        if cap is None:
            return ids, nothing
        xp = namespace(ids)
        flat = xp.reshape(ids, (-1,))
        # group by expert; within an expert the heaviest (probs) or the
        # earliest (position) first, ties to the earlier: two stable sorts
        if self.drop_policy == "probs":
            by_weight = xp.argsort(-xp.reshape(gate, (-1,)), stable=True)
            order = xp.take(by_weight, xp.argsort(xp.take(flat, by_weight), stable=True))
        else:
            order = xp.argsort(flat, stable=True)
        grouped = xp.take(flat, order)
        rank_in_expert = xp.arange(grouped.shape[0], dtype=grouped.dtype,
                                   device=device(ids)) - xp.searchsorted(grouped, grouped)
        losers = xp.take(order, xp.nonzero((rank_in_expert >= cap) & (grouped >= 0))[0])
        if losers.shape[0] == 0:
            return ids, nothing
        lost = xp.take(flat, losers)
        marks = scatter_add(xp.zeros(flat.shape, dtype=flat.dtype, device=device(ids)),
                            losers, xp.ones(lost.shape, dtype=flat.dtype, device=device(ids)))
        kept = xp.where(marks > 0, -1, flat)
        return xp.reshape(kept, ids.shape), counts(lost, self.num_experts)

    def _destination_maps(self) -> List[np.ndarray]:
        """Per hop, expert -> destination rank (host int64 [E]): the owner;
        for two hops first the owner's node's rank with this local rank."""
        owner = np.arange(self.num_experts) // self.local_experts
        if not self.hierarchical:
            return [owner]
        topology = self.comm.topology
        local = topology.local_rank
        forwarder = np.array([topology.ranks_of(topology.node_of(r))[local]
                              for r in range(self.comm.size)])
        return [forwarder[owner], owner]

    def _hop(self, rows: Any, ids: Any, gate: Any, destination: Any):
        """Send each row once to every rank its experts map to under
        ``destination``; each copy carries the ids and weights that rank
        serves (-1 and 0 for the others). Returns (hop, rows, ids, gate)
        as received."""
        xp = namespace(ids)
        tokens, k = ids.shape
        valid = ids >= 0
        dest = xp.take(destination, xp.reshape(xp.where(valid, ids, 0), (-1,)))
        dest = xp.where(valid, xp.reshape(dest, (tokens, k)), -1)
        # one copy per distinct (rank, row), rank-major: sorted keys rank * T + row
        row = xp.arange(tokens, dtype=ids.dtype, device=device(ids))
        keys = xp.sort(xp.reshape(dest * tokens + row[:, None], (-1,)))
        first = xp.concat([xp.ones(min(1, keys.shape[0]), dtype=xp.bool, device=device(ids)),
                           keys[1:] != keys[:-1]])
        keys = keys[first & (keys >= 0)]  # invalid slots have negative keys
        rank_of_copy, send_rows = keys // max(tokens, 1), keys % max(tokens, 1)
        starts = xp.arange(self.comm.size + 1, dtype=keys.dtype, device=device(ids)) * tokens
        send_counts = np.diff(to_host(xp.searchsorted(keys, starts))).astype(np.int64)

        serves = xp.take(dest, send_rows, axis=0) == rank_of_copy[:, None]
        meta = xp.concat([xp.where(serves, xp.astype(xp.take(ids, send_rows, axis=0),
                                                     xp.float32), -1.0),
                          xp.where(serves, xp.take(gate, send_rows, axis=0), 0.0)], axis=1)
        out, recv_counts = self.comm.alltoallv(xp.take(rows, send_rows, axis=0), send_counts)
        meta_in, _ = self.comm.alltoallv(meta, send_counts, recv_counts)
        hop = _Hop(send_rows, send_counts, recv_counts, int(rows.shape[0]))
        return hop, out, xp.astype(meta_in[:, :k], ids.dtype), meta_in[:, k:]

    def _expand(self, rows: Any, ids: Any, gate: Any):
        """One row per (arrival, local expert), grouped by local expert,
        arrivals in order within an expert. Returns (expert_x, arrival rows,
        slots, weights, rows per local expert)."""
        xp = namespace(ids)
        k = ids.shape[1]
        flat = xp.reshape(ids, (-1,))
        per_expert = counts(flat - self.comm.rank * self.local_experts, self.local_experts)
        # -1 (not served here) sorts first, then this rank's experts in order
        order = xp.argsort(flat, stable=True)
        pairs = order[flat.shape[0] - int(per_expert.sum()):]
        arrival, slot = pairs // k, pairs % k
        return (xp.take(rows, arrival, axis=0), arrival, slot,
                xp.take(xp.reshape(gate, (-1,)), pairs), per_expert)

    # -- combine --------------------------------------------------------------
    @staticmethod
    def _combine_problem(expert_y: Any, handle: DispatchHandle) -> Optional[Exception]:
        try:
            framework_of("expert_y", expert_y)
            _require_one_place([("expert_y", expert_y),
                                ("the dispatch's arrays", handle.arrival_rows)])
        except ValueError as error:
            return error
        expected = int(handle.arrival_rows.shape[0])
        if expert_y.ndim < 1 or expert_y.shape[0] != expected:
            return ValueError(f"expert_y must have one row per expert_x row ({expected}), "
                              f"got shape {tuple(expert_y.shape)}")
        return None

    def combine(self, expert_y: Any, handle: DispatchHandle) -> Any:
        """y[t] = sum_j weights[t, j] * expert_y of (t, experts[t, j]),
        summed where the experts are and sent back once per rank visited;
        zero for a token with no (kept) expert. In expert_y's framework and
        dtype; the sums are float32, the rows travel in expert_y's dtype."""
        problem = self._combine_problem(expert_y, handle)
        facts = (f"dtype {dtype_name(expert_y)}", f"row shape {tuple(expert_y.shape[1:])}") \
            if problem is None else ()
        self.comm.agree("moe.combine", *facts, problem=problem)
        return self._to_tokens(expert_y, handle, handle.arrival_weights)

    # -- gradients (commlib.bindings): the same paths, mirrored ------------------
    def dispatch_backward(self, d_expert_x: Any, handle: DispatchHandle) -> Any:
        """d x from d expert_x (the dispatch's framework): each expert row's
        gradient summed back to its token along the combine path."""
        return self._to_tokens(d_expert_x, handle)

    def combine_backward(self, expert_y: Any, d_y: Any, handle: DispatchHandle,
                         k: int) -> Tuple[Any, Any]:
        """(d expert_y, d weights [T, k] float32) from d y (the dispatch's
        framework): d y travels the dispatch path to the expert rows, where
        d expert_y = w * d y and each slot's d w = <d y, expert_y> travels
        back to its token."""
        xp = namespace(expert_y)
        arrived = float32(xp.take(self.send_rows(d_y, handle), handle.arrival_rows, axis=0))
        weights = xp.reshape(handle.arrival_weights, (-1,) + (1,) * (arrived.ndim - 1))
        d_expert_y = xp.astype(arrived * weights, expert_y.dtype)
        dots = xp.sum(arrived * float32(expert_y), axis=tuple(range(1, arrived.ndim)))
        slots = handle.arrival_rows * k + handle.arrival_slots
        per_slot = scatter_add(xp.zeros(handle.received_rows * k, dtype=xp.float32,
                                        device=device(expert_y)), slots, dots)
        return d_expert_y, self.return_rows(xp.reshape(per_slot, (handle.received_rows, k)),
                                            handle)

    def _to_tokens(self, expert_rows: Any, handle: DispatchHandle, weights: Any = None) -> Any:
        """Expert rows (optionally weighted) summed in float32 per arrival,
        then back to their tokens: combine's path, and dispatch's adjoint."""
        xp = namespace(expert_rows)
        rows = xp.zeros((handle.received_rows,) + tuple(expert_rows.shape[1:]),
                        dtype=xp.float32, device=device(expert_rows))
        rows = scatter_add(rows, handle.arrival_rows, expert_rows, scale=weights)
        return self.return_rows(rows, handle, expert_rows.dtype)

    # -- the two directions of the dispatch path ---------------------------------
    def return_rows(self, rows: Any, handle: DispatchHandle, dtype: Any = None) -> Any:
        """Per-arrival rows [received, ...] back along the dispatch path to
        the tokens [T, ...], summing the copies of a token in float32 (the
        adjoint of ``send_rows``). Travels as ``dtype`` (default: as is)."""
        xp = namespace(rows)
        wire = rows.dtype if dtype is None else dtype
        width = tuple(rows.shape[1:])
        for hop in reversed(handle.hops):
            back, _ = self.comm.alltoallv(xp.astype(rows, wire, copy=False), hop.recv_counts,
                                          hop.send_counts)
            rows = scatter_add(xp.zeros((hop.sources,) + width, dtype=xp.float32,
                                        device=device(rows)), hop.send_rows, back)
        return xp.astype(rows, wire, copy=False)

    def send_rows(self, tokens: Any, handle: DispatchHandle) -> Any:
        """Per-token rows [T, ...] along the dispatch path to the arrivals
        [received, ...], one copy per rank a token visits (the adjoint of
        ``return_rows``)."""
        xp = namespace(tokens)
        rows = tokens
        for hop in handle.hops:
            rows, _ = self.comm.alltoallv(xp.take(rows, hop.send_rows, axis=0),
                                          hop.send_counts, hop.recv_counts)
        return rows
