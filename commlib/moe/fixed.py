"""The per-destination fixed-capacity dispatch path, flat or two-hop
(``max_tokens_per_rank`` C): every hop's block to a rank has a fixed
number of rows, known from C, the capacity factor and the topology alone;
empty slots carry the id -1, so no count crosses the host and the device is
never read. What does not fit is dropped and counted on the device, until
``Dispatcher.collect_stats()``. A token travels once per rank it visits;
combine and the backwards follow its route (``commlib.moe.routed``). The
flat fixed capacity without a capacity factor takes the low-latency slots
instead while their rows are small (``commlib.moe.lowlatency``)."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple, Union

import array_api_extra as xpx
import numpy as np

from ..namespace import (
    as_bytes,
    bincount,
    device,
    framework,
    from_bytes,
    index_dtype,
    namespace,
    to_host,
)
from . import pipeline
from .expand import GatheredRows, ScatteredRows
from .experts import DispatchPlan, Experts
from .hops import Hop, copy_keys, lookup, take_sent
from .pipeline import TwoHopRoute
from .routed import DispatchHandle, RoutedPath
from .wire import PendingMoE, Wire

__all__ = ["FixedPath", "slots", "fixed_blocks"]


def slots(keys: Any, first: Any, sources: int, caps: Any, starts: Any,
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


def fixed_blocks(put: Callable[[np.ndarray], Any], rows: np.ndarray) -> tuple:
    """A fixed-capacity hop's blocks of ``rows[d]`` rows to each rank d:
    (rows and where each block starts, beside the data; the total; the
    host rows)."""
    return put(rows), put(np.cumsum(rows) - rows), int(rows.sum()), rows


class FixedPath(RoutedPath):
    """A ``Dispatcher`` with ``max_tokens_per_rank``, two-hop, with a
    capacity factor, or with rows too large for the low-latency slots:
    expert_x [local experts, slots, H], expert e's first
    ``tokens_per_expert[e]`` rows real."""

    def __init__(self, experts: Experts):
        super().__init__(experts)
        self.name = "fixed per-destination " + ("two-hop" if experts.hierarchical else "flat")
        self._unreported: Dict[Tuple[str, str], Any] = {}  # counts on devices

    def expert_shape(self, x: Any, k: int) -> Optional[Tuple[int, ...]]:
        """[local experts, P * per source cap, H...] (``layout``'s slots)."""
        mine = self.experts
        cap = mine.max_tokens_per_rank
        per_source = min(cap, mine.capacity(cap, k) or cap)
        return (mine.local_experts, self.comm.size * per_source) + tuple(x.shape[1:])

    def dispatch(self, x: Any, experts: Any, weights: Any, wire: Optional[Wire],
                 facts: Tuple[str, ...], problem: Optional[Exception]
                 ) -> Tuple[PendingMoE, None]:
        """The plan, the agreement, then the hops (no statistics until
        they are collected)."""
        plan = None if problem is not None else self.experts.plan(x, experts, weights)
        self.comm.agree("moe.dispatch", *facts, problem=problem)
        xp = namespace(x)
        meta = as_bytes(xp.concat([xp.astype(plan.ids, xp.float32), plan.gate], axis=1))
        return self._exchange(plan, meta, wire), None

    def _exchange(self, plan: DispatchPlan, meta: Any, wire: Wire) -> PendingMoE:
        """Capacity known in advance: every hop's blocks have a fixed number
        of rows per destination (empty slots carry the id -1), so no count
        crosses the host and the device is never read."""
        mine = self.experts
        xp = namespace(meta)
        tokens, k = int(meta.shape[0]), plan.ids.shape[1]
        row_bytes = int(wire.payload.shape[1])
        layout = self.layout(meta, k, row_bytes)
        maps = mine.device_maps(meta)
        blank = mine.blank(meta, k)

        def rows_of(meta: Any, payload: Any, send_rows: Any, sources: int) -> Any:
            empty = (send_rows >= sources)[:, None]
            return xp.concat([xp.where(empty, blank, take_sent(meta, send_rows, sources)),
                              take_sent(payload, send_rows, sources)], axis=1)

        caps, starts, total, host_caps = layout["hops"][0]
        first_rows, lost, sent = slots(plan.keys, plan.first, tokens, caps, starts, total)
        first = Hop(first_rows, host_caps, host_caps, tokens)
        overflow = self._overflowed(plan, lost, maps[0])
        count = mine.num_slots
        # kept in [0, E), overflowed in [E, 2E): one count of both
        both = bincount(xp.where(overflow & (plan.ids >= 0), plan.ids + count, plan.ids),
                        2 * count)
        counts = [both[:count], both[count:] + (plan.dropped if plan.dropped is not None else 0),
                  plan.invalid, sent * row_bytes]

        if mine.hierarchical:
            route: Union[Hop, TwoHopRoute] = TwoHopRoute(first, layout["pieces"],
                                                         layout["pieces"], token_ranges=False)

            def forward_chunk(chunk: int, arrived: Any) -> Tuple[Any, Hop]:
                caps, starts, total, host_caps = layout["hops"][1 + chunk]
                sources = int(arrived.shape[0])
                keys, first = copy_keys(lookup(maps[1], mine.served(arrived, k, maps[0])))
                # never overflows (see layout)
                send_rows, _, more = slots(keys, first, sources, caps, starts, total)
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
            ids = mine.served(arrived, k, maps[-1])
            gate = xp.concat([xp.reshape(from_bytes(arrived[:, 4 * k:8 * k], xp.float32, (k,)),
                                         (-1,)), xp.zeros(1, dtype=xp.float32,
                                                          device=device(ids))])
            arrival, slot, pair, slot_rows, per_expert, spilled = \
                self._expand(ids, layout["slots"])
            received = int(arrived.shape[0])
            expert_x = wire.deliver(tuple(
                xp.reshape(take_sent(a, arrival, received),
                           (mine.local_experts, layout["slots"]) + tuple(a.shape[1:]))
                for a in wire.decode(arrived[:, 8 * k:])))
            counts[1] = counts[1] + spilled
            counts[0] = counts[0] - spilled
            self._note(xp.concat([xp.astype(c, index_dtype(ids)) for c in counts]))
            expert_rows = mine.local_experts * layout["slots"]
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
                                    received, (mine.local_experts, layout["slots"]), self)
            return expert_x, handle
        return PendingMoE(finish)

    def layout(self, like: Any, k: int, row_bytes: int) -> dict:
        """Rows per destination on each hop and slots per
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
        mine = self.experts
        C = mine.max_tokens_per_rank
        per_source = min(C, mine.capacity(C, k) or C)
        size, local = self.comm.size, mine.local_experts
        topology = self.comm.topology
        if not mine.hierarchical:
            blocks = [np.full(size, min(C, local * per_source), np.int64)]
            return mine.beside(like, ("fixed", k), lambda put: {
                "hops": [fixed_blocks(put, h) for h in blocks], "slots": size * per_source})
        node_ranks = len(topology.ranks_of(topology.node_of(self.comm.rank)))
        first = min(C, local * node_ranks * per_source)
        chunks = mine.pipeline_chunks or (
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
            return {"hops": [fixed_blocks(put, h) for h in blocks], "slots": size * per_source,
                    "pieces": pipeline.even_pieces(blocks[0], chunks)}
        return mine.beside(like, ("fixed", k, chunks), make)

    def _expand(self, ids: Any, slots: int) -> Tuple[Any, ...]:
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
        local, pairs = self.experts.local_experts, ids.shape[0] * ids.shape[1]
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
            served, grouped + self.comm.rank * local + local, -1)), local + self.experts.num_slots)
        return (xp.where(padding, received, pair // max(k, 1)),
                xp.where(padding, 0, pair % max(k, 1)), pair, slot_rows,
                both[:local], both[local:])

    def _overflowed(self, plan: DispatchPlan, lost: Any, destination: Any) -> Any:
        """[T, k]: the assignments whose (destination, token) copy found no
        slot on hop 1 (more than ``max_tokens_per_rank`` tokens here)."""
        xp = namespace(plan.ids)
        tokens = plan.ids.shape[0]
        if not math.prod(plan.ids.shape):
            return plan.ids >= 0
        dest = lookup(destination, plan.ids)
        row = xp.arange(tokens, dtype=dest.dtype, device=device(dest))[:, None]
        key = xp.reshape(xp.where(dest >= 0, dest * tokens + row, -1), (-1,))
        at = xp.clip(xp.searchsorted(plan.keys, key), 0, plan.keys.shape[0] - 1)
        return xp.reshape(xp.take(lost, at) & (key >= 0), plan.ids.shape)

    def _note(self, counts: Any) -> None:
        """Add a dispatch's counts [requested E | dropped E | invalid |
        bytes to each rank P] to those not yet collected, on their device
        (reading them would make the host wait)."""
        key = (framework(counts), str(device(counts)))
        held = self._unreported.get(key)
        self._unreported[key] = counts if held is None else held + counts

    def unreported(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The counts noted since the last collection, on the host (one copy
        from each device), cleared: (kept per slot, dropped per slot,
        traffic [P, P] in payload bytes, invalid ids)."""
        count, size = self.experts.num_slots, self.comm.size
        local = np.zeros(2 * count + 1 + size, np.int64)
        for counts in self._unreported.values():
            local += to_host(counts).astype(np.int64)
        self._unreported.clear()
        traffic = np.zeros((size, size), np.int64)
        traffic[self.comm.rank] = local[2 * count + 1:]
        return local[:count], local[count:2 * count], traffic, int(local[2 * count])
