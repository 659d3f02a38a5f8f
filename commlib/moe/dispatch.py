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
What does not fit (more than C tokens, or more than C assignments of an
expert from one rank, which only a token naming an expert more than once
makes) is dropped and counted; the counts stay on the device until
``collect_stats()``. A token naming an expert twice is two assignments in
every mode and layout: two rows of ``expert_x``, counted twice, each
weighed by its own weight in combine.

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
    on_cuda,
    sum_rows,
    to_host,
)
from . import contract, pipeline
from .call import Counts, DispatchHandle, PendingMoE, Plan, Wire
from .expand import Expansion
from .fixed import FixedCapacity
from .hops import Hop, copy_keys, lookup, take_sent
from .lowlatency import LowLatency, LowLatencyHandle
from .pipeline import TwoHopRoute
from .placement import Placement
from .quantize import dequantize_fp8, quantize_fp8
from .stats import DispatchStats


class Dispatcher(FixedCapacity, LowLatency):
    """Expert-parallel dispatch and combine over ``comm``: expert e of
    ``num_experts`` lives on rank ``e // (num_experts // comm.size)``.
    ``max_tokens_per_rank`` selects the fixed-capacity mode.

    ``placement`` (a ``commlib.moe.Placement`` of ``num_experts`` logical
    experts on ``comm.size`` ranks, the same on every rank): the experts laid
    out are its physical slots instead, slot p on rank
    ``p // slots_per_rank``. The router's ids stay logical; each is sent to
    the slot ``placement.replica_table[comm.rank]`` names for it and the
    token's row (each replica an equal share of the expert's tokens: those
    on this rank first, then on its node, then any), so ``expert_x`` is
    grouped by this rank's slots, slot j running logical expert
    ``placement.slots[rank][j]``. Capacities are per logical expert and
    applied before the replica is chosen: the same assignments are dropped
    as without a placement.

    ``pipeline_chunks``: the chunks a two-hop dispatch cuts its inter-node
    hop into, 1 for none; None, the default, chooses from the bytes
    (``commlib.moe.pipeline``). Flat dispatch has one hop, so it refuses a
    count above 1. The attribute may be changed between dispatches: each
    dispatch checks it and agrees on it with every rank."""

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None,
                 placement: Optional[Placement] = None):
        contract.agree_options(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                               max_tokens_per_rank, pipeline_chunks, placement=placement)
        self.comm = comm
        self.pipeline_chunks = pipeline_chunks
        self.num_experts = num_experts
        self.placement = placement
        self.num_slots = contract.slot_count(num_experts, placement)
        self.local_experts = self.num_slots // comm.size  # slots on each rank
        self._slot_experts = None if placement is None else placement.physical_to_logical
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.hierarchical = hierarchical
        self.max_tokens_per_rank = max_tokens_per_rank
        self.stats = DispatchStats.zeros(num_experts, comm.size, self.num_slots)
        self._hop_maps = self._destination_maps()
        self._on_device: Dict[tuple, Any] = {}
        self._unreported: Dict[Tuple[str, str], Any] = {}  # fixed capacity: counts on devices
        self._noted: Dict[tuple, Any] = {}     # the low-latency path's counts on devices
        self._shapes: Dict[tuple, Any] = {}    # the low-latency path's tables, per shape
        self._exchanges: Dict[tuple, list] = {}  # its exchange buffers, free between calls

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
        wire = self._wire(x, quantize, dequantize) if problem is None else None
        if self._low_latency(wire) and framework(x) != "jax":  # JAX arrays are immutable
            # the framework and device kind too: the exchange buffers are kept per both,
            # and making a new set is collective (the path is agreed on with them: ranks
            # whose rows differ in size may have chosen differently)
            facts = () if problem is not None else self._facts(
                x, experts, quantize, dequantize) + ("low-latency layout", framework(x),
                                                     f"cuda={on_cuda(x)}")
            self.comm.agree("moe.dispatch", *facts, problem=problem)
            return self._dispatch_low_latency(x, experts, weights, wire)
        plan = counts = None
        if problem is None:
            plan = self._plan(x, experts, weights)
            if self.max_tokens_per_rank is None:
                counts = self._host_counts(plan)
                problem = contract.range_problem(self.num_experts, *counts.id_range)
        facts = self._facts(x, experts, quantize, dequantize) if problem is None else ()
        if self.max_tokens_per_rank is None and not self.hierarchical:
            # flat counted: the rows each peer sends here and the stats' sum ride the
            # agreement (no count exchange, no allreduce of their own)
            size, count = self.comm.size, self.num_slots
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

    def _dispatch_counted(self, plan: Plan, counts: Counts, meta: Any,
                          wire: Wire, total: Optional[np.ndarray] = None) -> PendingMoE:
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
            stats = DispatchStats.gather(self.comm, counts.requested, counts.dropped, traffic,
                                         slot_experts=self._slot_experts)
        else:  # summed by the agreement (dispatch_async counted the same traffic)
            stats = DispatchStats.from_total(self.comm, total, self.num_slots,
                                             self._slot_experts)
        self.stats = self.stats + stats
        first_expert = self.comm.rank * self.local_experts
        per_expert = stats.tokens_per_slot[first_expert:first_expert
                                           + self.local_experts].copy()
        maps = self._device_maps(meta)

        if self.hierarchical:
            route: Union[Hop, TwoHopRoute] = TwoHopRoute(
                Hop(first_rows, chunked.sent.sum(axis=0), chunked.received.sum(axis=0), tokens),
                chunked.sent, chunked.received, token_ranges=True)
            pairs = chunked.pairs.tolist()

            def forward_chunk(chunk: int, arrived: Any) -> Tuple[Any, Hop]:
                sources = int(arrived.shape[0])
                keys, first = copy_keys(lookup(maps[1], self._served(arrived, k, maps[0])))
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

    def _facts(self, x: Any, experts: Any, quantize: Optional[str],
               dequantize: bool) -> Tuple[str, ...]:
        """What every rank's dispatch must share."""
        return (f"k={experts.shape[-1] if experts.ndim == 2 else None}",
                f"row shape {tuple(x.shape[1:])}", f"dtype {dtype_name(x)}",
                f"quantize={quantize}", f"dequantize={bool(dequantize)}",
                f"pipeline_chunks={self.pipeline_chunks}")

    def _wire(self, x: Any, quantize: Optional[str], dequantize: bool) -> Wire:
        """x's rows as the bytes that travel and how the owner reads them:
        x's dtype as is, or FP8 (the scales' bytes, then the values')."""
        row_shape = tuple(x.shape[1:])
        def single(parts):
            return parts[0]
        if quantize is None:
            return Wire(as_bytes(contiguous(x)),
                         lambda raw: (from_bytes(raw, x.dtype, row_shape),), single)
        values, scales = quantize_fp8(x)
        split, blocks = scales.shape[1] * 4, tuple(scales.shape[1:])
        xp = namespace(x)

        def decode(raw):
            parts = (from_bytes(raw[:, split:], values.dtype, row_shape),
                     from_bytes(raw[:, :split], xp.float32, blocks))
            return (dequantize_fp8(*parts, x.dtype),) if dequantize else parts
        return Wire(xp.concat([as_bytes(scales), as_bytes(values)], axis=1), decode,
                     single if dequantize else tuple)

    def _plan(self, x: Any, experts: Any, weights: Any) -> Plan:
        """Capacity and hop 1's copies, on the device. Ids outside [-1, E)
        are treated as -1 here (counted in ``invalid``), so that no gather
        reads out of bounds before they are refused (or, under a fixed
        capacity, reported). Under a placement the capacity is applied to
        the logical ids, so the same assignments are dropped as without one,
        and then the kept ones become slots (``Plan.ids`` are slots)."""
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
        lost = self._capacity_losses(ids, gate)
        if self.placement is not None:
            ids = self._slots_of(ids)
        dropped = None
        if lost is not None:
            dropped = bincount(xp.where(lost, ids, -1), self.num_slots)
            ids = xp.where(lost, -1, ids)
        keys, first = copy_keys(lookup(maps[0], ids))
        return Plan(ids, gate, keys, first, dropped, invalid, extremes)

    def _slots_of(self, ids: Any) -> Any:
        """[T, k] logical ids -> the slots this rank sends them to: token t
        takes column ``t % columns`` of ``placement.replica_table[rank]``
        (one gather)."""
        xp = namespace(ids)
        columns = self.placement.columns
        table = self._beside(ids, ("replicas",), lambda put: put(
            np.array(self.placement.replica_table[self.comm.rank]).reshape(-1)))  # writable
        row = xp.arange(ids.shape[0], dtype=ids.dtype, device=device(ids))[:, None] % columns
        return lookup(table, xp.where(ids >= 0, ids * columns + row, -1))

    def _host_counts(self, plan: Plan) -> Counts:
        """The dispatch's one copy to the host: [rows per (chunk, rank) on
        hop 1 | (two hops) rows and assignments per (chunk, owner) after
        forwarding | assignments per expert | (capacity) drops per expert |
        smallest id, largest id]. Chunks: the token ranges of a pipelined
        two-hop dispatch (``pipeline.token_chunks``), one otherwise."""
        xp = namespace(plan.ids)
        size, count = self.comm.size, self.num_slots
        chunks = self._counted_chunks()
        maps = self._device_maps(plan.ids)
        tokens = max(plan.ids.shape[0], 1)
        dest = plan.keys // tokens
        if chunks > 1:
            dest = pipeline.token_chunks(plan.keys % tokens, tokens, chunks) * size + dest
        parts = [bincount(xp.where(plan.first, dest, -1), chunks * size)]
        if self.hierarchical:  # distinct owners per token: the rows forwarded to each
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
        per_owner = [chunks * size] * (2 if self.hierarchical else 0)
        split = np.cumsum([chunks * size] + per_owner
                          + [count] + ([count] if plan.dropped is not None else []))
        pieces = np.split(host, split)
        forward = assigned = None
        if self.hierarchical:
            forward, assigned = (pieces.pop(1).reshape(chunks, size) for _ in range(2))
        dropped = pieces[2] if plan.dropped is not None else np.zeros(count, np.int64)
        return Counts(pieces[0].reshape(chunks, size), forward, assigned, pieces[1], dropped,
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

    def _capacity_losses(self, ids: Any, gate: Any) -> Optional[Any]:
        """[T, k]: the assignments beyond their expert's capacity from this
        rank (None without a capacity). A fixed capacity without a capacity
        factor has room for C = ``max_tokens_per_rank`` assignments of each
        expert from each rank (the low-latency layout's slots): only a token
        naming an expert more than once can need more, and the latest are
        dropped, in every layout alike. Fixed-size masks throughout."""
        cap, policy = self._capacity(*ids.shape), self.drop_policy
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

    def _served(self, message: Any, k: int, destination: Any) -> Any:
        """The expert ids of arrived rows [rows, k] that ``destination`` (a
        hop map) sends to this rank, -1 for the others: every copy of a
        token carries all its ids, and each rank keeps its own."""
        xp = namespace(message)
        ids = xp.astype(from_bytes(message[:, :4 * k], xp.float32, (k,)),
                        destination.dtype)
        return xp.where(lookup(destination, ids) == self.comm.rank, ids, -1)

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
        count, size = self.num_slots, self.comm.size
        local = np.zeros(2 * count + 1 + size, np.int64)
        for counts in self._unreported.values():
            local += to_host(counts).astype(np.int64)
        self._unreported.clear()
        traffic = np.zeros((size, size), np.int64)
        traffic[self.comm.rank] = local[2 * count + 1:]
        kept, dropped, received, invalid = self._low_latency_counts()
        stats = DispatchStats.gather(self.comm, local[:count] + kept,
                                     local[count:2 * count] + dropped, traffic + received,
                                     invalid=int(local[2 * count]) + invalid,
                                     slot_experts=self._slot_experts)
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
        if isinstance(handle, LowLatencyHandle):
            return self._combine_low_latency(expert_y, handle)
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
        if isinstance(handle, LowLatencyHandle):
            return self._dispatch_backward_low_latency(d_expert_x, handle)
        return self._to_tokens(d_expert_x, handle).wait()

    def combine_backward(self, expert_y: Any, d_y: Any, handle: DispatchHandle,
                         k: int) -> Tuple[Any, Any]:
        """(d expert_y, d weights [T, k] float32) from d y (the dispatch's
        framework): d y travels the dispatch path to the expert rows, where
        d expert_y = w * d y and each slot's d w = <d y, expert_y> travels
        back to its token."""
        if isinstance(handle, LowLatencyHandle):
            return self._combine_backward_low_latency(expert_y, d_y, handle)
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
