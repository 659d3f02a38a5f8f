"""The counted dispatch path, flat or two-hop (pipelined): the rows each
hop sends are exactly the copies, counted on the device and read by the
host once per dispatch (one ``to_host`` of a small vector: rows per
destination rank; for two hops, also the rows each forwarder will pass on;
the per-expert counts and drops the stats report; and the smallest and
largest expert id, checked on the host). Everything else is counted on the
device with a fixed-size scatter-add (``namespace.bincount``) and compacted
to the sizes those counts give (``namespace.compact``). Flat, the rows each
peer sends here and the stats' sum ride the dispatch's agreement; two hops
go in chunks (``commlib.moe.pipeline``), each forwarded inside its node and
expanded by its owners while the next one crosses. Combine and both
backwards read nothing from the device: they reuse the counts kept in the
handle (``commlib.moe.routed``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from ..namespace import as_bytes, bincount, compact, device, from_bytes, namespace, to_host
from . import contract, pipeline
from .expand import Expansion
from .experts import DispatchPlan, Experts
from .hops import Hop, copy_keys, lookup
from .pipeline import TwoHopRoute
from .routed import DispatchHandle, RoutedPath
from .stats import DispatchStats
from .wire import PendingMoE, Wire

__all__ = ["CountedPath", "Counts"]


@dataclass
class Counts:
    """The host counts of a dispatch without a fixed capacity, per chunk of
    a pipelined two-hop dispatch (one chunk otherwise)."""

    send: np.ndarray               # [chunks, P] rows to each rank on hop 1
    forward: Optional[np.ndarray]  # two hops: [chunks, P] rows each owner will get
    assigned: Optional[np.ndarray]  # two hops: [chunks, P] assignments to each owner
    requested: np.ndarray         # assignments per expert after capacity
    dropped: np.ndarray           # assignments per expert over capacity
    id_range: Tuple[int, int]
    receive: Optional[np.ndarray] = None  # flat: [P] rows from each rank, from the agreement


class CountedPath(RoutedPath):
    """A ``Dispatcher`` without ``max_tokens_per_rank``: expert_x [rows, H]
    grouped by local expert, its rows known when the dispatch runs."""

    def __init__(self, experts: Experts):
        super().__init__(experts)
        self.name = "counted two-hop" if experts.hierarchical else "counted flat"

    def expert_shape(self, x: Any, k: int) -> Optional[Tuple[int, ...]]:
        """None: the rows are known only when the dispatch runs."""
        return None

    def unreported(self) -> None:
        """Nothing: every dispatch gathers its own statistics."""
        return None

    def dispatch(self, x: Any, experts: Any, weights: Any, wire: Optional[Wire],
                 facts: Tuple[str, ...], problem: Optional[Exception]
                 ) -> Tuple[PendingMoE, DispatchStats]:
        """The plan and its one host copy (whose id range is checked), the
        agreement, then the hops: the dispatch in flight and its global
        statistics."""
        mine, comm = self.experts, self.comm
        plan = counts = None
        if problem is None:
            plan = mine.plan(x, experts, weights)
            counts = self._host_counts(plan)
            problem = contract.range_problem(mine.num_experts, *counts.id_range)
        facts = facts if problem is None else ()
        total = None
        if not mine.hierarchical:
            # flat: the rows each peer sends here and the stats' sum ride the
            # agreement (no count exchange, no allreduce of their own)
            size, count = comm.size, mine.num_slots
            carry = np.zeros((size, 1 + 2 * count + size * size + 1), np.int64)
            if problem is None:
                traffic = np.zeros((size, size), np.int64)
                traffic[comm.rank] = counts.send[0] * int(wire.payload.shape[1])
                carry[:, 0] = counts.send[0]
                carry[:, 1:] = DispatchStats.local(counts.requested, counts.dropped, traffic)
            received = comm.agree("moe.dispatch", *facts, problem=problem, carry=carry)
            counts.receive = received[:, 0].copy()
            total = received[:, 1:].sum(axis=0)
        else:
            comm.agree("moe.dispatch", *facts, problem=problem)
        xp = namespace(x)
        meta = as_bytes(xp.concat([xp.astype(plan.ids, xp.float32), plan.gate], axis=1))
        return self._exchange(plan, counts, meta, wire, total)

    def _exchange(self, plan: DispatchPlan, counts: Counts, meta: Any, wire: Wire,
                  total: Optional[np.ndarray]) -> Tuple[PendingMoE, DispatchStats]:
        """Counts known on the host: each hop's rows are exactly the copies,
        and each chunk's rows are placed in expert_x as the chunk lands."""
        mine, comm = self.experts, self.comm
        xp = namespace(meta)
        message = xp.concat([meta, wire.payload], axis=1)
        tokens, k = int(message.shape[0]), plan.ids.shape[1]
        row_bytes = int(wire.payload.shape[1])
        first_rows = compact(plan.keys % max(tokens, 1), plan.first, int(counts.send.sum()))
        traffic = np.zeros((comm.size, comm.size), np.int64)
        if mine.hierarchical:
            chunked = pipeline.exchange_counts(comm, counts.send, counts.forward,
                                               counts.assigned, mine.pipeline_chunks, row_bytes)
            traffic[comm.rank] = (chunked.sent.sum(axis=0)
                                  + chunked.forwarded.sum(axis=0)) * row_bytes
        else:
            traffic[comm.rank] = counts.send[0] * row_bytes
        if total is None:
            stats = DispatchStats.gather(comm, counts.requested, counts.dropped, traffic,
                                         slot_experts=mine.slot_experts)
        else:  # summed by the agreement (dispatch counted the same traffic)
            stats = DispatchStats.from_total(comm, total, mine.num_slots, mine.slot_experts)
        first_expert = comm.rank * mine.local_experts
        per_expert = stats.tokens_per_slot[first_expert:first_expert
                                           + mine.local_experts].copy()
        maps = mine.device_maps(meta)

        if mine.hierarchical:
            route: Union[Hop, TwoHopRoute] = TwoHopRoute(
                Hop(first_rows, chunked.sent.sum(axis=0), chunked.received.sum(axis=0), tokens),
                chunked.sent, chunked.received, token_ranges=True)
            pairs = chunked.pairs.tolist()

            def forward_chunk(chunk: int, arrived: Any) -> Tuple[Any, Hop]:
                sources = int(arrived.shape[0])
                keys, first = copy_keys(lookup(maps[1], mine.served(arrived, k, maps[0])))
                hop = Hop(compact(keys % max(sources, 1), first,
                                  int(chunked.forwarded[chunk].sum())),
                          chunked.forwarded[chunk], chunked.delivered[chunk], sources)
                route.second.append(hop)
                return xp.take(arrived, hop.send_rows, axis=0), hop
            started = route.start(comm, lambda c: xp.take(message, route.chunk_rows(c), axis=0))
        else:
            route = Hop(first_rows, counts.send[0], counts.receive, tokens)
            pairs, forward_chunk = [int(per_expert.sum())], None
            started = route.start(comm, lambda c: xp.take(message, first_rows, axis=0))

        def finish():
            expansion = Expansion(per_expert, first_expert, wire.decode, meta, route.chunks)
            for chunk, arrived in enumerate(route.arriving(comm, started, forward_chunk)):
                expansion.add(mine.served(arrived, k, maps[-1]),
                              from_bytes(arrived[:, 4 * k:8 * k], xp.float32, (k,)),
                              arrived[:, 8 * k:], pairs[chunk])
            handle = DispatchHandle(per_expert, stats, route, expansion.chunks,
                                    *expansion.by_expert_row(), expansion.arrivals, path=self)
            return wire.deliver(tuple(expansion.parts)), handle
        return PendingMoE(finish), stats

    def _host_counts(self, plan: DispatchPlan) -> Counts:
        """The dispatch's one copy to the host: [rows per (chunk, rank) on
        hop 1 | (two hops) rows and assignments per (chunk, owner) after
        forwarding | assignments per expert | (capacity) drops per expert |
        smallest id, largest id]. Chunks: the token ranges of a pipelined
        two-hop dispatch (``pipeline.token_chunks``), one otherwise."""
        mine = self.experts
        xp = namespace(plan.ids)
        size, count = self.comm.size, mine.num_slots
        chunks = self._chunks()
        maps = mine.device_maps(plan.ids)
        tokens = max(plan.ids.shape[0], 1)
        dest = plan.keys // tokens
        if chunks > 1:
            dest = pipeline.token_chunks(plan.keys % tokens, tokens, chunks) * size + dest
        parts = [bincount(xp.where(plan.first, dest, -1), chunks * size)]
        if mine.hierarchical:  # distinct owners per token: the rows forwarded to each
            owners = xp.sort(lookup(maps[-1], plan.ids), axis=1)
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
        per_owner = [chunks * size] * (2 if mine.hierarchical else 0)
        split = np.cumsum([chunks * size] + per_owner
                          + [count] + ([count] if plan.dropped is not None else []))
        pieces = np.split(host, split)
        forward = assigned = None
        if mine.hierarchical:
            forward, assigned = (pieces.pop(1).reshape(chunks, size) for _ in range(2))
        dropped = pieces[2] if plan.dropped is not None else np.zeros(count, np.int64)
        return Counts(pieces[0].reshape(chunks, size), forward, assigned, pieces[1], dropped,
                      (int(pieces[-1][0]), int(pieces[-1][1])))

    def _chunks(self) -> int:
        """Token ranges a counted dispatch counts its rows in: a two-hop
        dispatch's ``pipeline_chunks``, or, by default, the most chunks the
        count exchange may merge them into (``pipeline.exchange_counts``);
        one for flat dispatch or a single node."""
        mine = self.experts
        if not mine.hierarchical:
            return 1
        if mine.pipeline_chunks is not None:
            return mine.pipeline_chunks
        return pipeline.AUTO_MOST_CHUNKS if self.comm.topology.num_nodes > 1 else 1
