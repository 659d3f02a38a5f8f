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

Fixed capacity (``max_tokens_per_rank`` C, DeepEP's low-latency layout):
every hop's block to a rank has a fixed number of rows, known from C, the
capacity factor and the topology alone; empty slots carry the id -1, so the
counts travel inside the payload and a dispatch or combine is one exchange
per hop with known sizes, no count exchange and no read of the device.
``expert_x`` is [local experts, P * per-source cap, H], each expert's rows
first, padding after (``tokens_per_expert`` on the device says how many).
What does not fit (more than C tokens, or an expert named twice in a token)
is dropped and counted; the counts stay on the device until
``collect_stats()``.

FP8 (``quantize="fp8"``): the sender quantizes each row to e4m3 with a
float32 scale per 128 channels (``commlib.moe.quantize``); the owner gets
(values, scales), or x's dtype back with ``dequantize=True``. Combine
travels in expert_y's dtype.

Overlap: ``dispatch_async`` / ``combine_async`` return once the first hop
is in flight; ``wait()`` finishes it. Over MPI the progress thread moves
the bytes meanwhile (``commlib.progress``). Two hops are pipelined
(``commlib.moe.pipeline``): the inter-node hop goes in chunks, each
forwarded inside its node and expanded by its owners (``commlib.moe.expand``)
while the next one crosses, and combine sends each chunk back while the
owners sum the next; the sums are one exchange's, bit for bit.

Everything runs in the caller's framework, on its device (torch ops for torch
tensors, ``jax.numpy`` for JAX arrays, NumPy for NumPy): permutations,
metadata, expansion and sums. Only the rows cross into the transport, in
their own dtype (bfloat16 stays bfloat16 on the wire), each with its
token's expert ids and weights (float32) in the same message; weights and
sums are float32.

Without a fixed capacity the host waits for the device once per dispatch: one ``to_host`` of a small
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
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

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
    from_bytes,
    index_dtype,
    namespace,
    sum_rows,
    to_host,
)
from . import contract, pipeline
from .expand import Expansion, GatheredRows, ScatteredRows
from .hops import Hop, take_sent
from .pipeline import TwoHopRoute
from .quantize import dequantize_fp8, quantize_fp8
from .stats import DispatchStats


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch, and what the dispatch saw.

    ``tokens_per_expert[e]``: rows of ``expert_x`` for this rank's local
    expert e: host int64, or, under a fixed capacity, an array in x's
    framework on its device (the dispatch reads nothing back). ``stats``:
    the global picture of this dispatch (None under a fixed capacity:
    ``Dispatcher.collect_stats()`` gathers those). ``route``: the way the
    rows came, flat (one ``Hop``) or two-hop (a ``TwoHopRoute``), with
    ``send`` and ``back`` along it; ``owned``: how combine sums the expert
    rows per arrival, one record per chunk of the route, or one for every
    chunk (``commlib.moe.expand``). The index arrays are in the caller's
    framework, on its device."""

    tokens_per_expert: Any
    stats: Optional[DispatchStats]
    route: Union[Hop, TwoHopRoute] = field(repr=False)
    owned: List[Union[ScatteredRows, GatheredRows]] = field(repr=False)
    arrival_rows: Any = field(repr=False)     # received row of each expert row (padding: R)
    arrival_slots: Any = field(repr=False)    # which of the token's k slots it is
    arrival_weights: Any = field(repr=False)  # its routing weight (float32; padding: 0)
    received_rows: int = field(repr=False)
    expert_shape: Tuple[int, ...] = field(default=(), repr=False)  # fixed: (local experts, slots)


class PendingMoE:
    """A dispatch or combine in flight: ``wait()`` gives its result, once.
    Dropped without a wait, its transfer fails the communicator, so the
    next call raises on every rank instead of hanging."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish: Optional[Callable[[], Any]] = finish

    def wait(self) -> Any:
        if self._finish is None:
            raise RuntimeError("this dispatch or combine was already waited on")
        finish, self._finish = self._finish, None
        return finish()


@dataclass
class _Plan:
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


@dataclass
class _Counts:
    """The host counts of a dispatch without a fixed capacity, per chunk of
    a pipelined two-hop dispatch (one chunk otherwise)."""

    send: np.ndarray               # [chunks, P] rows to each rank on hop 1
    forward: Optional[np.ndarray]  # two hops: [chunks, P] rows each owner will get
    assigned: Optional[np.ndarray]  # two hops: [chunks, P] assignments to each owner
    requested: np.ndarray         # assignments per expert after capacity
    dropped: np.ndarray           # assignments per expert over capacity
    id_range: Tuple[int, int]
    receive: Optional[np.ndarray] = None  # flat: [P] rows from each rank, from the agreement


@dataclass
class _Wire:
    """How x's rows travel: their bytes [T, n]; how the owner reads the
    received bytes back (x's rows, FP8 values and scales, or those already
    dequantized: once per received row, before the rows are expanded into
    one per expert); and how the expanded parts make ``expert_x``."""

    payload: Any
    decode: Callable[[Any], Tuple[Any, ...]]
    deliver: Callable[[Tuple[Any, ...]], Any]


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


def _slots(keys: Any, first: Any, sources: int, caps: Any, starts: Any,
           total: int) -> Tuple[Any, Any, Any]:
    """Fixed capacity: each (destination, row) copy's place in the send
    buffer, whose block for destination d holds ``caps[d]`` rows from
    ``starts[d]`` on. Returns (the source row of each of the ``total``
    sent rows, ``sources`` for an empty slot; the copies that did not fit,
    per key; rows sent to each destination). Fixed sizes, on the device."""
    xp = namespace(keys)
    kind = keys.dtype
    dest = xp.where(first, keys // max(sources, 1), 0)
    copy = xp.cumulative_sum(xp.astype(first, kind)) - 1  # rank-major, over all copies
    per_dest = bincount(xp.where(first, dest, -1), caps.shape[0])
    slot = copy - xp.take(xp.cumulative_sum(per_dest) - per_dest, dest)
    fits = first & (slot < xp.take(caps, dest))
    target = xp.where(fits, xp.take(starts, dest) + slot, total)  # total: a spare slot
    rows = xp.full(total + 1, sources, dtype=kind, device=device(keys))
    rows = xpx.at(rows)[target].set(keys % max(sources, 1))[:total]
    return rows, first & ~fits, xp.minimum(per_dest, caps)


def _fixed_blocks(put: Callable[[np.ndarray], Any], rows: np.ndarray) -> tuple:
    """A fixed-capacity hop's blocks of ``rows[d]`` rows to each rank d:
    (rows and where each block starts, beside the data; the total; the
    host rows)."""
    return put(rows), put(np.cumsum(rows) - rows), int(rows.sum()), rows


class Dispatcher:
    """Expert-parallel dispatch and combine over ``comm``: expert e of
    ``num_experts`` lives on rank ``e // (num_experts // comm.size)``.
    ``max_tokens_per_rank`` selects the fixed-capacity mode.

    ``pipeline_chunks``: the chunks a two-hop dispatch cuts its inter-node
    hop into, 1 for none; None, the default, chooses from the bytes
    (``commlib.moe.pipeline``). Flat dispatch has one hop, so it refuses a
    count above 1. The attribute may be changed between dispatches: each
    dispatch checks it and agrees on it with every rank."""

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None):
        contract.agree_options(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                               max_tokens_per_rank, pipeline_chunks)
        self.comm = comm
        self.pipeline_chunks = pipeline_chunks
        self.num_experts = num_experts
        self.local_experts = num_experts // comm.size
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.hierarchical = hierarchical
        self.max_tokens_per_rank = max_tokens_per_rank
        self.stats = DispatchStats.zeros(num_experts, comm.size)
        self._hop_maps = self._destination_maps()
        self._on_device: Dict[tuple, Any] = {}
        self._unreported: Dict[Tuple[str, str], Any] = {}  # fixed capacity: counts on devices

    # -- dispatch ---------------------------------------------------------------
    def dispatch(self, x: Any, experts: Any, weights: Any, *, quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, DispatchHandle]:
        """Send each token's row to the ranks of its experts. ``x`` [T, H];
        ``experts`` [T, k] int (-1: no expert); ``weights`` [T, k]; all three
        of one framework, on one device. Returns ``expert_x`` grouped by
        local expert, in x's framework, and the handle for ``combine``:
        [rows, H] in x's dtype, or under a fixed capacity [local experts,
        slots, H] whose first ``tokens_per_expert[e]`` rows of expert e are
        real (the rest is padding, never read back). ``quantize="fp8"``:
        the rows travel as e4m3 with a float32 scale per 128 channels, and
        ``expert_x`` is (values, scales), or x's dtype with ``dequantize``."""
        return self.dispatch_async(x, experts, weights, quantize=quantize,
                                   dequantize=dequantize).wait()

    def dispatch_async(self, x: Any, experts: Any, weights: Any, *,
                       quantize: Optional[str] = None, dequantize: bool = False) -> PendingMoE:
        """``dispatch``, returned as soon as its first hop is in flight:
        ``.wait()`` gives (expert_x, handle). Computation in between (another
        micro-batch's experts) overlaps the transfer; over MPI a progress
        thread moves it meanwhile. x must not change until the wait."""
        problem = contract.input_problem(x, experts, weights, quantize) \
            or contract.chunks_problem(self.pipeline_chunks, self.hierarchical)
        plan = counts = None
        if problem is None:
            plan = self._plan(x, experts, weights)
            if self.max_tokens_per_rank is None:
                counts = self._host_counts(plan)
                problem = contract.range_problem(self.num_experts, *counts.id_range)
        facts = self._facts(x, experts, quantize, dequantize) if problem is None else ()
        wire = self._wire(x, quantize, dequantize) if problem is None else None
        if self.max_tokens_per_rank is None and not self.hierarchical:
            # flat counted: the rows each peer sends here and the stats' sum ride the
            # agreement (no count exchange, no allreduce of their own)
            size, count = self.comm.size, self.num_experts
            carry = np.zeros((size, 1 + 2 * count + size * size + 1), np.int64)
            if problem is None:
                traffic = np.zeros((size, size), np.int64)
                traffic[self.comm.rank] = counts.send[0] * int(wire.payload.shape[1])
                carry[:, 0] = counts.send[0]
                carry[:, 1:] = DispatchStats.local(counts.requested, counts.dropped, traffic)
            received = self.comm.agree("moe.dispatch", *facts, problem=problem, carry=carry)
            counts.receive = received[:, 0].copy()
            total = received[:, 1:].sum(axis=0)
        else:
            total = self.comm.agree("moe.dispatch", *facts, problem=problem)
        xp = namespace(x)
        meta = as_bytes(xp.concat([xp.astype(plan.ids, xp.float32), plan.gate], axis=1))
        if self.max_tokens_per_rank is None:
            return self._dispatch_counted(plan, counts, meta, wire, total)
        return self._dispatch_fixed(plan, meta, wire)

    def _dispatch_counted(self, plan: _Plan, counts: _Counts, meta: Any,
                          wire: _Wire, total: Optional[np.ndarray] = None) -> PendingMoE:
        """Counts known on the host: each hop's rows are exactly the copies,
        and each chunk's rows are placed in expert_x as the chunk lands."""
        xp = namespace(meta)
        message = xp.concat([meta, wire.payload], axis=1)
        tokens, k = int(message.shape[0]), plan.ids.shape[1]
        row_bytes = int(wire.payload.shape[1])
        first_rows = compact(plan.keys % max(tokens, 1), plan.first, int(counts.send.sum()))
        traffic = np.zeros((self.comm.size, self.comm.size), np.int64)
        if self.hierarchical:
            chunked = pipeline.exchange_counts(self.comm, counts.send, counts.forward,
                                               counts.assigned, self.pipeline_chunks, row_bytes)
            traffic[self.comm.rank] = (chunked.sent.sum(axis=0)
                                       + chunked.forwarded.sum(axis=0)) * row_bytes
        else:
            traffic[self.comm.rank] = counts.send[0] * row_bytes
        if total is None:
            stats = DispatchStats.gather(self.comm, counts.requested, counts.dropped, traffic)
        else:  # summed by the agreement (dispatch_async counted the same traffic)
            stats = DispatchStats.from_total(self.comm, total, self.num_experts)
        self.stats = self.stats + stats
        first_expert = self.comm.rank * self.local_experts
        per_expert = stats.tokens_per_expert[first_expert:first_expert
                                             + self.local_experts].copy()
        maps = self._device_maps(meta)

        if self.hierarchical:
            route: Union[Hop, TwoHopRoute] = TwoHopRoute(
                Hop(first_rows, chunked.sent.sum(axis=0), chunked.received.sum(axis=0), tokens),
                chunked.sent, chunked.received, token_ranges=True)
            pairs = chunked.pairs.tolist()

            def forward_chunk(chunk: int, arrived: Any) -> Tuple[Any, Hop]:
                sources = int(arrived.shape[0])
                keys, first = _copy_keys(_lookup(maps[1], self._served(arrived, k, maps[0])))
                hop = Hop(compact(keys % max(sources, 1), first,
                                  int(chunked.forwarded[chunk].sum())),
                          chunked.forwarded[chunk], chunked.delivered[chunk], sources)
                route.second.append(hop)
                return xp.take(arrived, hop.send_rows, axis=0), hop
            started = route.start(self.comm, lambda c: xp.take(message, route.chunk_rows(c),
                                                               axis=0))
        else:
            route = Hop(first_rows, counts.send[0], counts.receive, tokens)
            pairs, forward_chunk = [int(per_expert.sum())], None
            started = route.start(self.comm, lambda c: xp.take(message, first_rows, axis=0))

        def finish():
            expansion = Expansion(per_expert, first_expert, wire.decode, meta,
                                  route.chunks)
            for chunk, arrived in enumerate(route.arriving(self.comm, started, forward_chunk)):
                expansion.add(self._served(arrived, k, maps[-1]),
                              from_bytes(arrived[:, 4 * k:8 * k], xp.float32, (k,)),
                              arrived[:, 8 * k:], pairs[chunk])
            handle = DispatchHandle(per_expert, stats, route, expansion.chunks,
                                    *expansion.by_expert_row(), expansion.arrivals)
            return wire.deliver(tuple(expansion.parts)), handle
        return PendingMoE(finish)

    def _dispatch_fixed(self, plan: _Plan, meta: Any, wire: _Wire) -> PendingMoE:
        """Capacity known in advance: every hop's blocks have a fixed number
        of rows per destination (empty slots carry the id -1), so no count
        crosses the host and the device is never read."""
        xp = namespace(meta)
        tokens, k = int(meta.shape[0]), plan.ids.shape[1]
        row_bytes = int(wire.payload.shape[1])
        layout = self._fixed_layout(meta, k, row_bytes)
        maps = self._device_maps(meta)
        blank = self._blank(meta, k)

        def rows_of(meta: Any, payload: Any, send_rows: Any, sources: int) -> Any:
            empty = (send_rows >= sources)[:, None]
            return xp.concat([xp.where(empty, blank, take_sent(meta, send_rows, sources)),
                              take_sent(payload, send_rows, sources)], axis=1)

        caps, starts, total, host_caps = layout["hops"][0]
        first_rows, lost, sent = _slots(plan.keys, plan.first, tokens, caps, starts, total)
        first = Hop(first_rows, host_caps, host_caps, tokens)
        overflow = self._overflowed(plan, lost, maps[0])
        count = self.num_experts
        # kept in [0, E), overflowed in [E, 2E): one count of both
        both = bincount(xp.where(overflow & (plan.ids >= 0), plan.ids + count, plan.ids),
                        2 * count)
        counts = [both[:count], both[count:] + (plan.dropped if plan.dropped is not None else 0),
                  plan.invalid, sent * row_bytes]

        if self.hierarchical:
            route: Union[Hop, TwoHopRoute] = TwoHopRoute(first, layout["pieces"],
                                                         layout["pieces"], token_ranges=False)

            def forward_chunk(chunk: int, arrived: Any) -> Tuple[Any, Hop]:
                caps, starts, total, host_caps = layout["hops"][1 + chunk]
                sources = int(arrived.shape[0])
                keys, first = _copy_keys(_lookup(maps[1], self._served(arrived, k, maps[0])))
                # never overflows (see _fixed_layout)
                send_rows, _, more = _slots(keys, first, sources, caps, starts, total)
                counts[3] = counts[3] + more * row_bytes
                hop = Hop(send_rows, host_caps, host_caps, sources)
                route.second.append(hop)
                return rows_of(arrived[:, :8 * k], arrived[:, 8 * k:], send_rows, sources), hop
            started = route.start(self.comm, lambda c: rows_of(meta, wire.payload,
                                                               route.chunk_rows(c), tokens))
        else:
            route, forward_chunk = first, None
            started = route.start(self.comm, lambda c: rows_of(meta, wire.payload, first_rows,
                                                               tokens))

        def finish():
            arrived = pipeline.joined(list(route.arriving(self.comm, started, forward_chunk)))
            ids = self._served(arrived, k, maps[-1])
            gate = xp.concat([xp.reshape(from_bytes(arrived[:, 4 * k:8 * k], xp.float32, (k,)),
                                         (-1,)), xp.zeros(1, dtype=xp.float32,
                                                          device=device(ids))])
            arrival, slot, pair, slot_rows, per_expert, spilled = \
                self._expand_fixed(ids, layout["slots"])
            received = int(arrived.shape[0])
            expert_x = wire.deliver(tuple(
                xp.reshape(take_sent(a, arrival, received),
                           (self.local_experts, layout["slots"]) + tuple(a.shape[1:]))
                for a in wire.decode(arrived[:, 8 * k:])))
            counts[1] = counts[1] + spilled
            counts[0] = counts[0] - spilled
            self._note(xp.concat([xp.astype(c, index_dtype(ids)) for c in counts]))
            expert_rows = self.local_experts * layout["slots"]
            weights = xp.take(gate, pair)
            if received * k <= expert_rows:  # gathering k slots per arrival touches fewer rows
                slot_weights = xp.where(slot_rows < expert_rows, gate[:-1], 0.0)
                split_rows, split_weights = (route.split(xp.reshape(a, (received, k)))
                                             for a in (slot_rows, slot_weights))
                owned = [GatheredRows(int(split_rows(c).shape[0]),
                                      xp.reshape(split_rows(c), (-1,)),
                                      xp.reshape(split_weights(c), (-1,)), k)
                         for c in range(route.chunks)]
            else:
                owned = [ScatteredRows(received, None, arrival, slot, weights)]
            handle = DispatchHandle(per_expert, None, route, owned, arrival, slot, weights,
                                    received, (self.local_experts, layout["slots"]))
            return expert_x, handle
        return PendingMoE(finish)

    def _facts(self, x: Any, experts: Any, quantize: Optional[str],
               dequantize: bool) -> Tuple[str, ...]:
        """What every rank's dispatch must share."""
        return (f"k={experts.shape[-1] if experts.ndim == 2 else None}",
                f"row shape {tuple(x.shape[1:])}", f"dtype {dtype_name(x)}",
                f"quantize={quantize}", f"dequantize={bool(dequantize)}",
                f"pipeline_chunks={self.pipeline_chunks}")

    def _wire(self, x: Any, quantize: Optional[str], dequantize: bool) -> _Wire:
        """x's rows as the bytes that travel and how the owner reads them:
        x's dtype as is, or FP8 (the scales' bytes, then the values')."""
        row_shape = tuple(x.shape[1:])
        def single(parts):
            return parts[0]
        if quantize is None:
            return _Wire(as_bytes(contiguous(x)),
                         lambda raw: (from_bytes(raw, x.dtype, row_shape),), single)
        values, scales = quantize_fp8(x)
        split, blocks = scales.shape[1] * 4, tuple(scales.shape[1:])
        xp = namespace(x)

        def decode(raw):
            parts = (from_bytes(raw[:, split:], values.dtype, row_shape),
                     from_bytes(raw[:, :split], xp.float32, blocks))
            return (dequantize_fp8(*parts, x.dtype),) if dequantize else parts
        return _Wire(xp.concat([as_bytes(scales), as_bytes(values)], axis=1), decode,
                     single if dequantize else tuple)

    def _plan(self, x: Any, experts: Any, weights: Any) -> _Plan:
        """Capacity and hop 1's copies, on the device. Ids outside [-1, E)
        are treated as -1 here (counted in ``invalid``), so that no gather
        reads out of bounds before they are refused (or, under a fixed
        capacity, reported)."""
        xp = namespace(x)
        kind, where = index_dtype(x), device(x)
        maps = self._device_maps(x)
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
        ids, dropped = self._apply_capacity(ids, gate)
        keys, first = _copy_keys(_lookup(maps[0], ids))
        return _Plan(ids, gate, keys, first, dropped, invalid, extremes)

    def _host_counts(self, plan: _Plan) -> _Counts:
        """The dispatch's one copy to the host: [rows per (chunk, rank) on
        hop 1 | (two hops) rows and assignments per (chunk, owner) after
        forwarding | assignments per expert | (capacity) drops per expert |
        smallest id, largest id]. Chunks: the token ranges of a pipelined
        two-hop dispatch (``pipeline.token_chunks``), one otherwise."""
        xp = namespace(plan.ids)
        size, count = self.comm.size, self.num_experts
        chunks = self._counted_chunks()
        maps = self._device_maps(plan.ids)
        tokens = max(plan.ids.shape[0], 1)
        dest = plan.keys // tokens
        if chunks > 1:
            dest = pipeline.token_chunks(plan.keys % tokens, tokens, chunks) * size + dest
        parts = [bincount(xp.where(plan.first, dest, -1), chunks * size)]
        if self.hierarchical:  # distinct owners per token: the rows forwarded to each
            owners = xp.sort(_lookup(maps[-1], plan.ids), axis=1)
            starts = xp.concat([xp.ones((owners.shape[0], min(1, owners.shape[1])),
                                        dtype=xp.bool, device=device(owners)),
                                owners[:, 1:] != owners[:, :-1]], axis=1)
            if chunks > 1:
                row = xp.arange(owners.shape[0], dtype=owners.dtype, device=device(owners))
                owners = xp.where(owners >= 0, pipeline.token_chunks(row, tokens, chunks)[:, None]
                                  * size + owners, -1)
            parts += [bincount(xp.where(starts, owners, -1), chunks * size),
                      bincount(owners, chunks * size)]
        parts.append(bincount(plan.ids, count))
        if plan.dropped is not None:
            parts.append(plan.dropped)
        host = to_host(xp.concat(parts + [plan.extremes])).astype(np.int64)
        per_owner = [chunks * size] * (2 if self.hierarchical else 0)
        split = np.cumsum([chunks * size] + per_owner
                          + [count] + ([count] if plan.dropped is not None else []))
        pieces = np.split(host, split)
        forward = assigned = None
        if self.hierarchical:
            forward, assigned = (pieces.pop(1).reshape(chunks, size) for _ in range(2))
        dropped = pieces[2] if plan.dropped is not None else np.zeros(count, np.int64)
        return _Counts(pieces[0].reshape(chunks, size), forward, assigned, pieces[1], dropped,
                       (int(pieces[-1][0]), int(pieces[-1][1])))

    def _counted_chunks(self) -> int:
        """Token ranges a counted dispatch counts its rows in: a two-hop
        dispatch's ``pipeline_chunks``, or, by default, the most chunks the
        count exchange may merge them into (``pipeline.exchange_counts``);
        one for flat dispatch or a single node."""
        if not self.hierarchical:
            return 1
        if self.pipeline_chunks is not None:
            return self.pipeline_chunks
        return pipeline.AUTO_MOST_CHUNKS if self.comm.topology.num_nodes > 1 else 1

    def _capacity(self, tokens: int, k: int) -> Optional[int]:
        """Assignments each expert takes from one rank."""
        return contract.capacity(tokens, k, self.num_experts, self.capacity_factor,
                                 self.max_tokens_per_rank)

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

    def _beside(self, like: Any, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` (host arrays, copied beside ``like`` in its index
        dtype) cached per framework, device and ``key``: copied to each
        device once, not once per dispatch (a copy from host memory can make
        the host wait, and a CUDA graph cannot capture it)."""
        full_key = (framework(like), str(device(like)), str(index_dtype(like))) + key
        if full_key not in self._on_device:
            xp = namespace(like)
            self._on_device[full_key] = make(
                lambda host: xp.asarray(host, dtype=index_dtype(like), device=device(like)))
        return self._on_device[full_key]

    def _blank(self, like: Any, k: int) -> Any:
        """An empty slot's routing metadata as bytes beside ``like``: ids -1,
        weights 0 (made once per device, not per dispatch)."""
        key = (framework(like), str(device(like)), "blank", k)
        if key not in self._on_device:
            xp = namespace(like)
            host = np.concatenate([np.full((1, k), -1.0, np.float32),
                                   np.zeros((1, k), np.float32)], axis=1)
            self._on_device[key] = xp.asarray(host.view(np.uint8), device=device(like))
        return self._on_device[key]

    def _device_maps(self, like: Any) -> List[Any]:
        """The hop maps beside ``like``."""
        return self._beside(like, ("maps",), lambda put: [put(m) for m in self._hop_maps])

    def _fixed_layout(self, like: Any, k: int, row_bytes: int) -> dict:
        """Fixed capacity: rows per destination on each hop and slots per
        local expert, from ``max_tokens_per_rank`` C alone, so that every
        rank sizes every buffer alike. Per source rank an expert takes at
        most ``per_source`` = C (or the capacity factor's cap) of its
        tokens; a block to a rank holds at most min(C, its experts *
        per_source) rows. Two hops: hop 1 to each forwarder (the rank with
        this local rank on each node), ``first`` = min(C, L * ranks per
        node * per_source) rows, cut into the pipeline's chunks of equal
        slot ranges ("pieces"); hop 2 of a chunk, from the forwarder to each
        owner of its node, nodes * min(chunk's slots, L * per_source) rows,
        which the forwarder can never exceed (one exchange's hop 2: nodes *
        min(C, L * per_source)). An expert's slots: P * per_source.
        ``row_bytes``: a row's payload, whence the default chunk count."""
        C = self.max_tokens_per_rank
        per_source = min(C, self._capacity(C, k) or C)
        size, local = self.comm.size, self.local_experts
        topology = self.comm.topology
        if not self.hierarchical:
            blocks = [np.full(size, min(C, local * per_source), np.int64)]
            return self._beside(like, ("fixed", k), lambda put: {
                "hops": [_fixed_blocks(put, h) for h in blocks], "slots": size * per_source})
        node_ranks = len(topology.ranks_of(topology.node_of(self.comm.rank)))
        first = min(C, local * node_ranks * per_source)
        chunks = self.pipeline_chunks or (
            pipeline.auto_chunks(first * row_bytes) if topology.num_nodes > 1 else 1)

        def make(put):
            mine = np.arange(size)
            same_local = np.array([topology.ranks_of(topology.node_of(r)).index(r)
                                   == topology.local_rank for r in mine])
            same_node = np.array([topology.node_of(r) == topology.node_of(self.comm.rank)
                                  for r in mine])
            slots = pipeline.even_pieces(np.array([first]), chunks)[:, 0]
            blocks = [np.where(same_local, first, 0)] + [
                np.where(same_node, topology.num_nodes * min(int(n), local * per_source), 0)
                for n in slots]
            return {"hops": [_fixed_blocks(put, h) for h in blocks], "slots": size * per_source,
                    "pieces": pipeline.even_pieces(blocks[0], chunks)}
        return self._beside(like, ("fixed", k, chunks), make)

    def _served(self, message: Any, k: int, destination: Any) -> Any:
        """The expert ids of arrived rows [rows, k] that ``destination`` (a
        hop map) sends to this rank, -1 for the others: every copy of a
        token carries all its ids, and each rank keeps its own."""
        xp = namespace(message)
        ids = xp.astype(from_bytes(message[:, :4 * k], xp.float32, (k,)),
                        destination.dtype)
        return xp.where(_lookup(destination, ids) == self.comm.rank, ids, -1)

    def _expand_fixed(self, ids: Any, slots: int) -> Tuple[Any, ...]:
        """Fixed capacity: expert e's rows are the ``slots`` rows from
        ``e * slots``, its arrivals first, as they came, padding after.
        Returns
        (arrival row per expert row, ``received`` for padding; its slot;
        its (arrival, slot) pair, R*k for padding; the inverse: the expert
        row of each pair, L * slots for none; rows per local expert;
        assignments per global expert that found no slot)."""
        xp = namespace(ids)
        kind, where = ids.dtype, device(ids)
        received, k = ids.shape
        local, pairs = self.local_experts, ids.shape[0] * ids.shape[1]
        flat = xp.reshape(ids, (-1,))
        expert = xp.where(flat >= 0, flat - self.comm.rank * local, local)  # local: none
        order = xp.argsort(expert, stable=True)
        grouped = xp.take(expert, order)
        position = xp.arange(pairs, dtype=kind, device=where) - xp.searchsorted(grouped, grouped)
        served = grouped < local
        fits = served & (position < slots)
        target = xp.where(fits, grouped * slots + position, local * slots)
        pair = xpx.at(xp.full(local * slots + 1, pairs, dtype=kind, device=where))[target] \
            .set(order)[:local * slots]
        padding = pair >= pairs
        rows = xp.arange(local * slots, dtype=kind, device=where)
        slot_rows = xpx.at(xp.full(pairs + 1, local * slots, dtype=kind, device=where))[pair] \
            .set(rows)[:pairs]
        # rows per local expert in [0, L), no slot per global expert in [L, L + E): one count
        both = bincount(xp.where(fits, grouped, xp.where(
            served, grouped + self.comm.rank * local + local, -1)), local + self.num_experts)
        return (xp.where(padding, received, pair // max(k, 1)),
                xp.where(padding, 0, pair % max(k, 1)), pair, slot_rows,
                both[:local], both[local:])

    def _overflowed(self, plan: _Plan, lost: Any, destination: Any) -> Any:
        """[T, k]: the assignments whose (destination, token) copy found no
        slot on hop 1 (more than ``max_tokens_per_rank`` tokens here)."""
        xp = namespace(plan.ids)
        tokens = plan.ids.shape[0]
        if not math.prod(plan.ids.shape):
            return plan.ids >= 0
        dest = _lookup(destination, plan.ids)
        row = xp.arange(tokens, dtype=dest.dtype, device=device(dest))[:, None]
        key = xp.reshape(xp.where(dest >= 0, dest * tokens + row, -1), (-1,))
        at = xp.clip(xp.searchsorted(plan.keys, key), 0, plan.keys.shape[0] - 1)
        return xp.reshape(xp.take(lost, at) & (key >= 0), plan.ids.shape)

    def _note(self, counts: Any) -> None:
        """Fixed capacity: add a dispatch's counts [requested E | dropped E |
        invalid | bytes to each rank P] to those not yet collected, on
        their device (reading them would make the host wait)."""
        key = (framework(counts), str(device(counts)))
        held = self._unreported.get(key)
        self._unreported[key] = counts if held is None else held + counts

    def collect_stats(self) -> DispatchStats:
        """Fixed capacity: the global stats of every dispatch since the last
        collection (one copy from each device, one allreduce), also added
        to ``stats``. Collective: every rank calls it. Expert ids outside
        [-1, E), which this mode cannot refuse without reading the device,
        are counted in ``invalid``."""
        count, size = self.num_experts, self.comm.size
        local = np.zeros(2 * count + 1 + size, np.int64)
        for counts in self._unreported.values():
            local += to_host(counts).astype(np.int64)
        self._unreported.clear()
        traffic = np.zeros((size, size), np.int64)
        traffic[self.comm.rank] = local[2 * count + 1:]
        stats = DispatchStats.gather(self.comm, local[:count], local[count:2 * count], traffic,
                                     invalid=int(local[2 * count]))
        self.stats = self.stats + stats
        return stats

    # -- combine --------------------------------------------------------------
    def combine(self, expert_y: Any, handle: DispatchHandle) -> Any:
        """y[t] = sum_j weights[t, j] * expert_y of (t, experts[t, j]),
        summed where the experts are and sent back once per rank visited;
        zero for a token with no (kept) expert. In expert_y's framework and
        dtype; the sums are float32, the rows travel in expert_y's dtype."""
        return self.combine_async(expert_y, handle).wait()

    def combine_async(self, expert_y: Any, handle: DispatchHandle) -> PendingMoE:
        """``combine``, returned as soon as the way back is in flight;
        ``.wait()`` gives y."""
        problem = contract.combine_problem(
            expert_y, handle.expert_shape or (int(handle.arrival_rows.shape[0]),),
            handle.arrival_rows)
        facts = (f"dtype {dtype_name(expert_y)}",
                 f"row shape {tuple(expert_y.shape[len(handle.expert_shape) or 1:])}") \
            if problem is None else ()
        self.comm.agree("moe.combine", *facts, problem=problem)
        return self._to_tokens(expert_y, handle, weighted=True)

    # -- gradients (commlib.bindings): the same paths, mirrored ------------------
    def dispatch_backward(self, d_expert_x: Any, handle: DispatchHandle) -> Any:
        """d x from d expert_x (the dispatch's framework): each expert row's
        gradient summed back to its token along the combine path."""
        return self._to_tokens(d_expert_x, handle).wait()

    def combine_backward(self, expert_y: Any, d_y: Any, handle: DispatchHandle,
                         k: int) -> Tuple[Any, Any]:
        """(d expert_y, d weights [T, k] float32) from d y (the dispatch's
        framework): d y travels the dispatch path to the expert rows, where
        d expert_y = w * d y and each slot's d w = <d y, expert_y> travels
        back to its token."""
        xp = namespace(expert_y)
        rows = self._expert_rows(expert_y, handle)
        arrived = float32(take_sent(self.send_rows(d_y, handle), handle.arrival_rows,
                                     handle.received_rows))
        weights = xp.reshape(handle.arrival_weights, (-1,) + (1,) * (arrived.ndim - 1))
        d_expert_y = xp.reshape(xp.astype(arrived * weights, expert_y.dtype), expert_y.shape)
        dots = xp.sum(arrived * float32(rows), axis=tuple(range(1, arrived.ndim)))
        slots = handle.arrival_rows * k + handle.arrival_slots  # padding: the spare R * k
        per_slot = sum_rows(dots, slots, handle.received_rows * k + 1)
        per_slot = xp.reshape(per_slot[:handle.received_rows * k], (handle.received_rows, k))
        return d_expert_y, self.return_rows(per_slot, handle)

    @staticmethod
    def _expert_rows(expert_rows: Any, handle: DispatchHandle) -> Any:
        """Expert rows as [rows, ...] (a fixed capacity's [L, slots, ...]
        flattened)."""
        if not handle.expert_shape:
            return expert_rows
        xp = namespace(expert_rows)
        return xp.reshape(expert_rows, (-1,) + tuple(expert_rows.shape[2:]))

    def _to_tokens(self, expert_rows: Any, handle: DispatchHandle,
                   weighted: bool = False) -> PendingMoE:
        """Expert rows (optionally weighted) summed in float32 per arrival,
        then back to their tokens: combine's path, and dispatch's adjoint.
        Each chunk of the route is summed when it can leave
        (``handle.owned``), so a pipelined route sends the first back while
        the rest are summed."""
        rows = self._expert_rows(expert_rows, handle)
        if len(handle.owned) < handle.route.chunks:  # one record for every chunk
            return PendingMoE(handle.route.back(
                self.comm, handle.route.split(handle.owned[0].sums(rows, weighted)), rows.dtype))

        def sums(chunk: int) -> Any:
            return handle.owned[chunk].sums(rows, weighted)
        return PendingMoE(handle.route.back(self.comm, sums, rows.dtype))

    # -- the two directions of the dispatch path ---------------------------------
    def return_rows(self, rows: Any, handle: DispatchHandle, dtype: Any = None) -> Any:
        """Per-arrival rows [received, ...] back along the dispatch path to
        the tokens [T, ...], summing the copies of a token in float32 (the
        adjoint of ``send_rows``). Travels as ``dtype`` (default: as is)."""
        return handle.route.back(self.comm, handle.route.split(rows),
                                 rows.dtype if dtype is None else dtype)()

    def send_rows(self, tokens: Any, handle: DispatchHandle) -> Any:
        """Per-token rows [T, ...] along the dispatch path to the arrivals
        [received, ...], one copy per rank a token visits (the adjoint of
        ``return_rows``)."""
        return handle.route.send(self.comm, tokens)
