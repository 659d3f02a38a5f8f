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
their own dtype (bfloat16 stays bfloat16 on the wire), each with its
token's expert ids and weights (float32) in the same message; weights and
sums are float32.

The host waits for the device once per dispatch: one ``to_host`` of a small
vector holding the counts the transport must know (rows per destination
rank; for two hops, also the rows each forwarder will pass on), the
per-expert counts and drops the stats report, and the smallest and largest
expert id, which are checked on the host. Everything else is counted on the
device with a fixed-size scatter-add (``namespace.bincount``) and compacted
to the sizes those counts give (``namespace.compact``); the owners' rows per
expert come from the stats' allreduce. Combine and both backwards read
nothing from the device: they reuse the counts kept in the handle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import array_api_extra as xpx
import numpy as np

from ..namespace import (
    as_bytes,
    bincount,
    compact,
    contiguous,
    device,
    dtype_name,
    float32,
    framework,
    framework_of,
    from_bytes,
    index_dtype,
    namespace,
    scatter_add,
    take_rows,
    to_host,
)
from .stats import DispatchStats

DROP_POLICIES = ("probs", "position")
# expert ids travel as float32 beside the weights (in each row's message);
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


@dataclass
class _Plan:
    """This rank's side of a dispatch, worked out on its device before
    anything moves; the host parts come from the dispatch's one copy."""

    ids: Any                  # [T, k] expert ids after capacity (-1: none)
    gate: Any                 # [T, k] float32 weights
    keys: Any                 # hop 1: sorted destination * T + row, one per slot
    first: Any                # keys that start a (destination, row) copy
    send_counts: np.ndarray   # host int64 [P]: rows to each rank on hop 1
    forward: Optional[np.ndarray]  # two hops: rows each owner will get [P]
    requested: np.ndarray     # host int64 [E]: assignments after capacity
    dropped: np.ndarray       # host int64 [E]: assignments over capacity
    id_range: Tuple[int, int]  # the smallest and largest expert id given


def _require_one_place(named: List[Tuple[str, Any]]) -> None:
    """Raise ValueError unless the arrays are of one framework, on one
    device: commlib computes where the data lives and never moves it."""
    places = [(framework(a), str(device(a))) for _, a in named]
    if len(set(places)) > 1:
        found = ", ".join(f"{name} {kind} on {where}" for (name, _), (kind, where)
                          in zip(named, places))
        raise ValueError(f"{found}: pass arrays of one framework on one device "
                         f"(convert the odd one out first)")


def _copy_keys(dest: Any) -> Tuple[Any, Any]:
    """``dest`` [rows, k] (-1: nowhere) as sorted keys ``dest * rows + row``
    and the mask of the keys that start a distinct (destination, row) copy:
    one copy per distinct pair, rank-major. Fixed sizes: nothing is read on
    the host."""
    xp = namespace(dest)
    rows = dest.shape[0]
    row = xp.arange(rows, dtype=dest.dtype, device=device(dest))
    keys = xp.sort(xp.reshape(dest * rows + row[:, None], (-1,)))
    first = xp.concat([xp.ones(min(1, keys.shape[0]), dtype=xp.bool, device=device(dest)),
                       keys[1:] != keys[:-1]])
    return keys, first & (keys >= 0)  # invalid slots have negative keys


def _lookup(table: Any, ids: Any) -> Any:
    """``table[ids]`` where ``ids >= 0``, -1 elsewhere (same shape as ids)."""
    xp = namespace(ids)
    valid = ids >= 0
    found = xp.take(table, xp.reshape(xp.where(valid, ids, 0), (-1,)))
    return xp.where(valid, xp.reshape(found, ids.shape), -1)


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
        self._maps_on_device: Dict[Tuple[str, str, str], List[Any]] = {}

    # -- dispatch ---------------------------------------------------------------
    def dispatch(self, x: Any, experts: Any, weights: Any) -> Tuple[Any, DispatchHandle]:
        """Send each token's row to the ranks of its experts. ``x`` [T, H];
        ``experts`` [T, k] int (-1: no expert); ``weights`` [T, k]; all three
        of one framework, on one device. Returns ``expert_x`` [rows, H]
        grouped by local expert, in x's framework and dtype, and the handle
        for ``combine``."""
        problem = self._problem(x, experts, weights)
        plan = None
        if problem is None:
            plan = self._plan(x, experts, weights)
            problem = self._range_problem(plan)
        facts = self._facts(x, experts) if problem is None else ()
        self.comm.agree("moe.dispatch", *facts, problem=problem)
        xp = namespace(x)
        maps = self._device_maps(x)
        k = plan.ids.shape[1]
        meta_bytes = 8 * k  # k ids and k weights, float32, ahead of the row's bytes
        meta = xp.concat([xp.astype(plan.ids, xp.float32), plan.gate], axis=1)
        message = xp.concat([as_bytes(meta), as_bytes(contiguous(x))], axis=1)
        send_counts = [plan.send_counts]
        recv_counts: List[Optional[np.ndarray]] = [None]
        if self.hierarchical:
            recv_first, forward = self._exchange_forward_counts(plan)
            send_counts.append(forward)
            recv_counts = [recv_first, None]
        traffic = np.zeros((self.comm.size, self.comm.size), np.int64)
        row_bytes = x.itemsize * math.prod(x.shape[1:])
        hops = []
        keys, first = plan.keys, plan.first
        for hop_index, counts in enumerate(send_counts):
            if hop_index:  # forward what arrived: the experts of this rank's node
                keys, first = _copy_keys(_lookup(maps[hop_index],
                                                 self._served(message, k, maps[hop_index - 1])))
            sources = int(message.shape[0])
            send_rows = compact(keys % max(sources, 1), first, int(counts.sum()))
            message, received = self.comm.alltoallv(xp.take(message, send_rows, axis=0),
                                                    counts, recv_counts[hop_index])
            hops.append(_Hop(send_rows, counts, received, sources))
            traffic[self.comm.rank] += counts * row_bytes
        ids = self._served(message, k, maps[-1])
        gate = from_bytes(message[:, 4 * k:meta_bytes], xp.float32, (k,))
        rows = from_bytes(message[:, meta_bytes:], x.dtype, tuple(x.shape[1:]))
        stats = DispatchStats.gather(self.comm, plan.requested, plan.dropped, traffic)
        self.stats = self.stats + stats
        first_expert = self.comm.rank * self.local_experts
        per_expert = stats.tokens_per_expert[first_expert:first_expert
                                             + self.local_experts].copy()
        expert_x, arrival_rows, arrival_slots, arrival_weights = \
            self._expand(rows, ids, gate, int(per_expert.sum()))
        handle = DispatchHandle(per_expert, stats, hops, arrival_rows, arrival_slots,
                                arrival_weights, int(rows.shape[0]))
        return expert_x, handle

    @staticmethod
    def _facts(x: Any, experts: Any) -> Tuple[str, ...]:
        """What every rank's dispatch must share."""
        return (f"k={experts.shape[-1] if experts.ndim == 2 else None}",
                f"row shape {tuple(x.shape[1:])}", f"dtype {dtype_name(x)}")

    def _problem(self, x: Any, experts: Any, weights: Any) -> Optional[Exception]:
        """What is wrong with the shapes and kinds of this rank's input
        (None: nothing); the values are checked by ``_range_problem``.
        Raised on every rank by ``agree``, so no rank is left waiting in a
        collective."""
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
        except ValueError as error:
            return error
        return None

    def _range_problem(self, plan: _Plan) -> Optional[Exception]:
        """Expert ids outside [-1, E), seen in the plan's host copy."""
        low, high = plan.id_range
        if low < -1 or high >= self.num_experts:
            return ValueError(f"expert indices must lie in [-1, {self.num_experts}) "
                              f"(-1: no expert), got values from {low} to {high}")
        return None

    def _plan(self, x: Any, experts: Any, weights: Any) -> _Plan:
        """Capacity, hop 1's copies and every count, on the device; then the
        dispatch's one copy to the host: [rows per rank on hop 1 | (two
        hops) rows per owner after forwarding | assignments per expert |
        (capacity) drops per expert | smallest id, largest id]. Ids outside
        [-1, E) are treated as -1 here, so that no gather reads out of
        bounds before ``_range_problem`` refuses them."""
        xp = namespace(x)
        kind, where = index_dtype(x), device(x)
        maps = self._device_maps(x)
        size, count = self.comm.size, self.num_experts
        ids = xp.astype(experts, kind, copy=False)
        if math.prod(ids.shape):
            extremes = [xp.reshape(xp.astype(xp.stack([xp.min(experts), xp.max(experts)]),
                                             kind), (2,))]
        else:
            extremes = [xp.asarray([-1, -1], dtype=kind, device=where)]
        ids = xp.where((ids >= -1) & (ids < count), ids, -1)
        gate = float32(weights)
        ids, dropped = self._apply_capacity(ids, gate)
        keys, first = _copy_keys(_lookup(maps[0], ids))
        tokens = max(ids.shape[0], 1)
        parts = [bincount(xp.where(first, keys // tokens, -1), size)]
        if self.hierarchical:  # distinct owners per token: the rows forwarded to each
            owners = xp.sort(_lookup(maps[-1], ids), axis=1)
            starts = xp.concat([xp.ones((owners.shape[0], min(1, owners.shape[1])),
                                        dtype=xp.bool, device=where),
                                owners[:, 1:] != owners[:, :-1]], axis=1)
            parts.append(bincount(xp.where(starts, owners, -1), size))
        parts.append(bincount(ids, count))
        if dropped is not None:
            parts.append(dropped)
        host = to_host(xp.concat(parts + extremes)).astype(np.int64)
        split = np.cumsum([size] + ([size] if self.hierarchical else []) + [count]
                          + ([count] if dropped is not None else []))
        pieces = np.split(host, split)
        forward = pieces.pop(1) if self.hierarchical else None
        send_counts, requested = pieces[0], pieces[1]
        dropped_host = pieces[2] if dropped is not None else np.zeros(count, np.int64)
        return _Plan(ids, gate, keys, first, send_counts, forward, requested, dropped_host,
                     (int(pieces[-1][0]), int(pieces[-1][1])))

    def _capacity(self, tokens: int, k: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return math.ceil(tokens * k / self.num_experts * self.capacity_factor)

    def _apply_capacity(self, ids: Any, gate: Any) -> Tuple[Any, Any]:
        """Drop the assignments beyond each expert's capacity from this rank:
        returns (ids with dropped ones set to -1, dropped per expert on the
        device, or None without a capacity). Fixed-size masks throughout."""
        cap = self._capacity(*ids.shape)
        if cap is None:
            return ids, None
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
        loses = (rank_in_expert >= cap) & (grouped >= 0)  # in sorted order
        lost = xpx.at(xp.zeros(flat.shape, dtype=xp.bool, device=device(ids)))[order].set(loses)
        kept = xp.where(lost, -1, flat)
        return (xp.reshape(kept, ids.shape),
                bincount(xp.where(loses, grouped, -1), self.num_experts))

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

    def _device_maps(self, like: Any) -> List[Any]:
        """The hop maps beside ``like``, in its index dtype: copied to each
        device once, not once per dispatch (a copy from host memory can
        make the host wait)."""
        key = (framework(like), str(device(like)), str(index_dtype(like)))
        if key not in self._maps_on_device:
            xp = namespace(like)
            self._maps_on_device[key] = [xp.asarray(m, dtype=index_dtype(like),
                                                    device=device(like))
                                         for m in self._hop_maps]
        return self._maps_on_device[key]

    def _exchange_forward_counts(self, plan: _Plan) -> Tuple[np.ndarray, np.ndarray]:
        """Two hops: every rank tells each forwarder how many rows it sends
        it and how many of those go on to each owner of the forwarder's node
        (one host all-to-all, in place of hop 1's own count exchange).
        Returns hop 1's receive counts and hop 2's send counts, so the
        forwarder needs no second look at the device."""
        topology, size = self.comm.topology, self.comm.size
        nodes = [list(topology.ranks_of(topology.node_of(r))) for r in range(size)]
        local = topology.local_rank  # this rank's forwarder on each node: the same local rank
        table = np.array([[plan.send_counts[r]] + [plan.forward[o] if nodes[r][local] == r
                                                   else 0 for o in nodes[r]]
                          for r in range(size)], dtype=np.int64)
        received = np.asarray(self.comm.alltoall(table))
        forward = np.zeros(size, np.int64)
        forward[nodes[self.comm.rank]] = received[:, 1:].sum(axis=0)
        return received[:, 0].copy(), forward

    def _served(self, message: Any, k: int, destination: Any) -> Any:
        """The expert ids of arrived rows [rows, k] that ``destination`` (a
        hop map) sends to this rank, -1 for the others: every copy of a
        token carries all its ids, and each rank keeps its own."""
        xp = namespace(message)
        ids = xp.astype(from_bytes(message[:, :4 * k], xp.float32, (k,)),
                        destination.dtype)
        return xp.where(_lookup(destination, ids) == self.comm.rank, ids, -1)

    def _expand(self, rows: Any, ids: Any, gate: Any, total: int):
        """One row per (arrival, local expert), grouped by local expert,
        arrivals in order within an expert; ``total`` such rows (known from
        the stats). Returns (expert_x, arrival rows, slots, weights)."""
        xp = namespace(ids)
        k = ids.shape[1]
        flat = xp.reshape(ids, (-1,))
        # -1 (not served here) sorts first, then this rank's experts in order
        order = xp.argsort(flat, stable=True)
        pairs = order[flat.shape[0] - total:]
        arrival, slot = pairs // k, pairs % k
        return (take_rows(rows, arrival), arrival, slot, xp.take(xp.reshape(gate, (-1,)), pairs))

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
