"""MoE dispatch and combine for JAX as one XLA program: drop-and-pad with a
fixed capacity, the permutation and the sums in ``jax.numpy``, one equal-chunk
all-to-all per direction (``TracedComm.alltoall``, a buffer callback on XLA's
own buffers), differentiable through ``jax.custom_vjp`` rules whose
backwards are traced too.

Layout. Expert e of E lives on rank ``e // L`` (``L = E // P`` local
experts). Each (source rank, expert) pair has ``capacity`` slots, so a
rank's send buffer is ``[E * capacity, H]``: slot ``(e, s)`` at row
``e * capacity + s``. Its i-th chunk of ``L * capacity`` rows goes to rank i,
and the owner lays what arrives out as ``expert_x [L, P * capacity, H]``:
row ``(l, r * capacity + s)`` is the s-th kept assignment of source rank r
to local expert l (in token order, by the core's slot rule,
``commlib.moe.lowlatency.places``; zero rows where a source sent fewer).
Combine sends the same rows back and gathers each (token, choice) from its
slot. The routing state is the handle (``JaxHandle``, a pytree): the traced
``key`` [T, k] (int32 row of the send buffer, -1 for a dropped or absent
choice), the weights combine multiplies by, and ``tokens_per_expert``:
nothing is kept on the host.

The contract is the core's (``commlib.moe.contract``): the same options
(``capacity_factor``, ``drop_policy``, ``max_tokens_per_rank``, FP8
``quantize``), the same error messages for the same bad input, and
``combine(expert_y, handle)``. Differences, refused rather than ignored:
``hierarchical=True`` (the exchange is one padded all-to-all that moves the
same chunk between every pair of ranks, so a two-hop route has no duplicate
rows to save), ``pipeline_chunks`` above 1 (there is no inter-node hop to
pipeline; None and 1 are accepted, and the attribute is read-only), and no
``dispatch_async``/``combine_async`` (XLA already schedules the transfer
against independent work).

What stays on the host: the trace-time agreement of shapes (``tc.agree``,
a mismatch or bad input raises ``CollectiveMismatchError`` on every rank
while JAX traces), and one small callback per dispatch that adds the
global counts to ``stats`` and raises on every rank if any rank passed an
expert id outside [-1, E) (a value inside ``jit`` is only known when the
program runs; the counts and id ranges of all ranks arrive with one small
all-to-all before it, so every rank reaches the same verdict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from commlib.errors import CollectiveMismatchError
from commlib.moe import contract
from commlib.moe.experts import replica_slots
from commlib.moe.lowlatency import places
from commlib.moe.placement import Placement
from commlib.moe.stats import DispatchStats
from commlib.moe.wire import Wire

from ._traced_comm import traced

__all__ = ["Dispatcher", "JaxHandle"]


class _Summed:
    """A communicator stand-in for ``DispatchStats.gather`` whose allreduce
    is the identity: the counts the dispatch callback gets are already the
    sums over ranks."""

    def __init__(self, comm):
        self.size, self.topology = comm.size, comm.topology

    @staticmethod
    def allreduce(local: np.ndarray) -> np.ndarray:
        return local


@jax.tree_util.register_dataclass
@dataclass
class JaxHandle:
    """A dispatch's handle (``commlib.moe.MoEHandle``), a pytree of traced
    arrays that may cross ``jit`` boundaries: ``key`` [T, k] int32 (the
    send-buffer row of each choice, -1: dropped or none), ``weights`` [T, k]
    (combine weighs by them and differentiates them) and
    ``tokens_per_expert`` [local experts] int32 (the real rows of each
    local expert's ``expert_x``, the first ones). ``stats`` is None: the
    counts reach ``Dispatcher.stats`` when the program runs."""

    key: Any
    weights: Any
    tokens_per_expert: Any

    @property
    def stats(self) -> Optional[DispatchStats]:
        return None


def _float0(a):
    """The cotangent of an integer array."""
    return np.zeros(a.shape, jax.dtypes.float0)


def _take_or_zero(rows, index):
    """``rows[index]`` along axis 0, zero where ``index`` is past the end
    (an empty slot), also when there are no rows at all (a rank with no
    tokens, which ``jnp.take`` refuses)."""
    if rows.shape[0] == 0:
        return jnp.zeros(index.shape + rows.shape[1:], rows.dtype)
    return jnp.take(rows, index, axis=0, mode="fill", fill_value=0)


def _rows(a, leading: int):
    """``a`` with its trailing (row) axes flattened to one."""
    return a.reshape(a.shape[:leading] + (math.prod(a.shape[leading:]),))


class Dispatcher:
    """Expert-parallel dispatch and combine for JAX arrays, jit-able and
    differentiable (``x``, ``weights`` and ``expert_y`` get gradients).

    ``dispatch(x, experts, weights) -> (expert_x, handle)``: ``x`` [T, H...],
    ``experts`` [T, k] integers (-1: no expert), ``weights`` [T, k];
    ``expert_x`` is [local_experts, size * capacity, H...] in x's dtype,
    zero where a slot is empty (``slots(T, k)`` gives the second size;
    ``handle.tokens_per_expert`` how many of each expert's rows are real).
    ``combine(expert_y, handle) -> y`` [T, H'...] in expert_y's dtype:
    ``y[t] = sum_j weights[t, j] * expert_y`` at the slot of (t, j), summed
    in float32; a dropped choice contributes 0. d weights[t, j] is
    ``<dy[t], expert_y row of (t, j)>`` (0 for dropped choices), as in
    ``commlib.moe.Dispatcher.combine_backward``.

    Capacity and drops as in ``commlib.moe``: each expert takes at most
    ``ceil(T * k / E * capacity_factor)`` assignments from each source rank
    (None: up to T, the layout's room, which only a token naming an expert
    more than once can exceed: the latest are dropped, counted);
    ``drop_policy="probs"`` keeps the heaviest, ``"position"`` the
    earliest, ties to the earlier (token, choice). A token naming an
    expert twice is two assignments, as in every Dispatcher.
    ``max_tokens_per_rank`` C: the layout comes from C instead of T (T
    replaced by C above), so T may differ between ranks (at most C each);
    otherwise T, k, x's row shape and dtype must be the same on every rank
    (the padded exchange needs one capacity). ``quantize="fp8"``: the rows
    travel as e4m3 with a float32 scale per 128 channels; ``expert_x`` is
    (values, scales), not differentiable in x, or x's dtype with
    ``dequantize=True``, the gradient passed straight through.

    ``stats``: the running ``DispatchStats`` of every dispatch that ran
    (global, the same on every rank): ``tokens_per_expert`` and ``dropped``
    as in the core; ``traffic`` counts the bytes that move, the padded
    ``local_experts * capacity`` rows per pair of ranks. Under
    ``jax.checkpoint`` a recomputed dispatch counts again.
    ``collect_stats()``: those since the last collection.

    ``placement`` (a ``commlib.moe.Placement``, static): as in the core, the
    layout's experts are its physical slots (``local_experts`` of them per
    rank, slot j of this rank running logical expert
    ``placement.slots[rank][j]``) and each logical id is sent to the slot
    ``placement.replica_table[rank]`` names for it and the token's row, a
    constant of the program; capacities apply to the logical ids first.
    """

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None,
                 placement: Optional[Placement] = None):
        contract.agree_options(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                               max_tokens_per_rank, pipeline_chunks, two_hop=False,
                               placement=placement)
        self.comm = comm
        self._pipeline_chunks = pipeline_chunks
        self.num_experts, self.placement = num_experts, placement
        self.num_slots = contract.slot_count(num_experts, placement)
        self.local_experts = self.num_slots // comm.size  # slots on each rank
        self._slot_experts = None if placement is None else placement.physical_to_logical
        # each logical expert's first slot: its drops are counted there (stats sum per expert)
        self._first_slots = None if placement is None else np.array(
            [slots[0] for slots in placement.logical_to_physical], np.int32)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.hierarchical, self.max_tokens_per_rank = hierarchical, max_tokens_per_rank
        self._traced = traced(comm)
        self._stats = DispatchStats.zeros(num_experts, comm.size, self.num_slots)
        self._uncollected = DispatchStats.zeros(num_experts, comm.size, self.num_slots)
        self._dispatchers: Dict[Tuple[str, bool], Callable] = {}  # per (quantize, dequantize)
        self._combine = jax.custom_vjp(self._combine_primal)
        self._combine.defvjp(self._combine_fwd, self._combine_bwd)

    @property
    def pipeline_chunks(self) -> Optional[int]:
        """None or 1, as given (read-only): the one padded exchange has no
        inter-node hop to pipeline."""
        return self._pipeline_chunks

    @property
    def stats(self) -> DispatchStats:
        return self._stats

    def collect_stats(self) -> DispatchStats:
        """The stats of every dispatch that ran since the last collection
        (already global: nothing to exchange)."""
        collected = self._uncollected
        self._uncollected = DispatchStats.zeros(self.num_experts, self.comm.size,
                                                self.num_slots)
        return collected

    def capacity(self, tokens: int, k: int) -> int:
        """Slots per (source rank, expert)."""
        layout = self.max_tokens_per_rank or tokens
        return contract.capacity(layout, k, self.num_experts, self.capacity_factor,
                                 None) or layout

    def slots(self, tokens: int, k: int) -> int:
        """Rows per local expert in the padded layout."""
        return self.comm.size * self.capacity(tokens, k)

    # -- trace-time checks -------------------------------------------------------
    def _dispatch_problem(self, x, experts, weights, quantize) -> Optional[Exception]:
        problem = contract.input_problem(x, experts, weights, quantize)
        if problem is None and not isinstance(experts, jax.core.Tracer) and experts.size:
            known = np.asarray(experts)  # known now: checked now
            problem = contract.range_problem(self.num_experts, int(known.min()),
                                             int(known.max()))
        return problem

    # -- the exchange: one send-buffer layout, two directions ---------------------
    def _to_owners(self, rows, capacity: int):
        """Send buffer [E * capacity, W] -> the owners' expert layout
        [L, P * capacity, W]."""
        size, local = self.comm.size, self.local_experts
        arrived = self._traced.alltoall(rows)  # chunk r: source r's [L, capacity] slots
        arrived = arrived.reshape((size, local, capacity) + rows.shape[1:])
        return jnp.swapaxes(arrived, 0, 1).reshape((local, size * capacity) + rows.shape[1:])

    def _to_sources(self, expert_rows, capacity: int):
        """Expert layout [L, P * capacity, W] -> each source's send-buffer
        layout [E * capacity, W] (the transpose of ``_to_owners``)."""
        size, local = self.comm.size, self.local_experts
        width = expert_rows.shape[2:]
        blocks = jnp.swapaxes(expert_rows.reshape((local, size, capacity) + width), 0, 1)
        return self._traced.alltoall(blocks.reshape((size * local * capacity,) + width))

    # -- routing: slots, drops and counts, in jnp -----------------------------------
    def _route(self, experts, weights, capacity: int):
        """(key [T, k] int32, counts [2E + 2] int32: kept per expert, dropped
        per expert (a logical expert's on its first slot), smallest and
        largest id; E the experts laid out, a placement's slots). Each
        expert keeps the core's capacity (from T, at most C, per logical
        expert) of the ``capacity`` slots the layout has: by
        ``drop_policy`` under a capacity factor; without one only a token
        naming an expert more than once can fill the slots, and the latest
        are dropped, as in the core's fixed capacity. A kept choice's
        slot is its place among the kept choices of its expert in token
        order, by the core's rule (``commlib.moe.lowlatency.places``).
        Fixed sizes, no host reads."""
        count = self.num_slots
        flat = experts.reshape(-1).astype(jnp.int32)
        valid = (flat >= 0) & (flat < self.num_experts)
        ids = jnp.where(valid, flat, -1)  # bad ids: none (refused when the program runs)
        logical = jnp.arange(self.num_experts, dtype=jnp.int32)
        limit = min(contract.capacity(*experts.shape, self.num_experts, self.capacity_factor,
                                      self.max_tokens_per_rank) or capacity, capacity)
        weighed = self.drop_policy == "probs" and self.capacity_factor is not None
        if weighed:  # within an expert heaviest first, ties by position
            by_weight = jnp.argsort(-weights.reshape(-1).astype(jnp.float32), stable=True)
            place, wanted = places(ids[by_weight], logical)
            place = jnp.zeros_like(place).at[by_weight].set(place, unique_indices=True)
        else:
            place, wanted = places(ids, logical)
        kept = valid & (place < limit)
        dropped = jnp.maximum(wanted - limit, 0)  # per logical expert
        kept_per_slot = wanted - dropped
        if self.placement is not None:  # logical ids -> this rank's slots, by token row
            table = jnp.asarray(self.placement.replica_table[self.comm.rank].reshape(-1),
                                jnp.int32)
            ids = replica_slots(ids.reshape(experts.shape), table,
                                self.placement.columns).reshape(-1)
            dropped = jnp.zeros(count, jnp.int32).at[self._first_slots].set(dropped)
        if weighed or self.placement is not None:  # slots in token order among the kept
            place, kept_per_slot = places(jnp.where(kept, ids, -1),
                                          jnp.arange(count, dtype=jnp.int32))
        key = jnp.where(kept, ids * capacity + place, -1).reshape(experts.shape)
        if flat.shape[0]:
            extremes = jnp.stack([jnp.min(experts), jnp.max(experts)]).astype(jnp.int32)
        else:
            extremes = jnp.array([-1, -1], jnp.int32)
        return key, jnp.concatenate([kept_per_slot, dropped, extremes])

    def _record(self, row_bytes: int, capacity: int):
        """The host side of a dispatch: every rank's counts [P, 2E + 2] in,
        the same verdict and the same stats on every rank."""
        count, size = self.num_slots, self.comm.size

        def record(table):
            table = np.asarray(table, np.int64)
            lines = [(rank, str(problem)) for rank, (low, high)
                     in enumerate(table[:, 2 * count:])
                     if (problem := contract.range_problem(self.num_experts, int(low),
                                                           int(high)))]
            if lines:
                raise CollectiveMismatchError(
                    "moe.dispatch was rejected by rank(s) "
                    + ", ".join(str(rank) for rank, _ in lines) + ":\n  "
                    + "\n  ".join(f"rank {rank}: {line}" for rank, line in lines))
            traffic = np.full((size, size), self.local_experts * capacity * row_bytes, np.int64)
            stats = DispatchStats.gather(_Summed(self.comm), table[:, :count].sum(axis=0),
                                         table[:, count:2 * count].sum(axis=0), traffic,
                                         slot_experts=self._slot_experts)
            self._stats = self._stats + stats
            self._uncollected = self._uncollected + stats
            return np.zeros((), np.uint8)
        return record

    # -- dispatch -----------------------------------------------------------------
    def dispatch(self, x, experts, weights, *, quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, JaxHandle]:
        """Send each token's row to the slots of its experts (see the class)."""
        mode, name = (quantize, bool(dequantize)), (repr(quantize), bool(dequantize))
        if name not in self._dispatchers:
            run = jax.custom_vjp(lambda x, experts, weights:
                                 self._dispatch_fwd(x, experts, weights, *mode)[0])
            run.defvjp(lambda x, experts, weights: self._dispatch_fwd(x, experts, weights,
                                                                      *mode),
                       lambda saved, cotangents: self._dispatch_bwd(saved, cotangents, *mode))
            self._dispatchers[name] = run
        return self._dispatchers[name](x, experts, weights)

    def _facts(self, x, experts, quantize, dequantize) -> Tuple[str, ...]:
        """What every rank's dispatch must share (T too, unless the layout
        comes from ``max_tokens_per_rank``)."""
        tokens = () if self.max_tokens_per_rank else (f"tokens {x.shape[0]}",)
        return tokens + (f"k={experts.shape[1]}", f"row shape {tuple(x.shape[1:])}",
                         f"dtype {x.dtype}", f"quantize={quantize}",
                         f"dequantize={bool(dequantize)}")

    def _wire(self, x, quantize: Optional[str], dequantize: bool):
        """x's rows [T, W] as they travel (x's dtype, or FP8 as the core's
        ``Wire`` packs it) and how the owner reads its [L, slots, W] back."""
        if quantize is None:
            return _rows(x, 1), lambda arrived: arrived.reshape(arrived.shape[:2] + x.shape[1:])
        wire = Wire.of(x, quantize, dequantize)

        def read(arrived):  # the core's reading of rows [R, W], then the slots' layout
            parts = wire.decode(arrived.reshape((-1, arrived.shape[2])))
            return wire.deliver(tuple(p.reshape(arrived.shape[:2] + p.shape[1:]) for p in parts))
        return wire.payload, read

    def _dispatch_fwd(self, x, experts, weights, quantize, dequantize):
        problem = self._dispatch_problem(x, experts, weights, quantize)
        facts = () if problem else self._facts(x, experts, quantize, dequantize)
        self._traced.agree("moe.dispatch", *facts, problem=problem)
        tokens, k = experts.shape
        capacity = self.capacity(tokens, k)
        rows, read = self._wire(x, quantize, dequantize)
        key, counts = self._route(experts, weights, capacity)
        send = _take_or_zero(rows, self._sources(key, capacity) // k)
        record = self._record(rows.dtype.itemsize * rows.shape[1], capacity)
        # the counts go with this dispatch's rows: JAX would otherwise hoist a
        # loop-invariant count exchange out of a scan, and count it once
        counts, send = jax.lax.optimization_barrier((counts, send))
        with self._traced.ordered():
            table = self._traced.alltoall(jnp.broadcast_to(counts, (self.comm.size,)
                                                           + counts.shape))
            verdict = io_callback(record, jax.ShapeDtypeStruct((), jnp.uint8), table)
            send, _ = jax.lax.optimization_barrier((send, verdict))  # rows move after it
            expert_x = read(self._to_owners(send, capacity))
        first = self.comm.rank * self.local_experts
        per_expert = table[:, first:first + self.local_experts].sum(axis=0)
        return (expert_x, JaxHandle(key, weights, per_expert)), (key, x[:0])

    def _dispatch_bwd(self, saved, cotangents, quantize, dequantize):
        key, no_rows = saved  # x's row shape and dtype, without its rows
        d_expert_x, d_handle = cotangents
        shape = key.shape[:1] + no_rows.shape[1:]
        if quantize is not None and not dequantize:  # (values, scales): no gradient to x
            return jnp.zeros(shape, no_rows.dtype), _float0(key), d_handle.weights
        capacity = self.capacity(*key.shape)
        with self._traced.ordered():
            back = self._to_sources(_rows(d_expert_x, 2), capacity)
        picked = self._gather(back, key, capacity).astype(jnp.float32)
        dx = picked.sum(axis=1).astype(no_rows.dtype)
        return dx.reshape(shape), _float0(key), d_handle.weights

    def _sources(self, key, capacity: int):
        """For each send-buffer row [E * capacity], its (token, choice) as
        t * k + j; T * k (past the end) for an empty slot. A scatter of
        indices, so the rows themselves move by a gather."""
        size = key.size
        where = jnp.where(key >= 0, key, self.num_slots * capacity).reshape(-1)
        return jnp.full(self.num_slots * capacity, size, jnp.int32).at[where].set(
            jnp.arange(size, dtype=jnp.int32), mode="drop", unique_indices=True)

    def _gather(self, rows, key, capacity: int):
        """The rows [T, k, W] of each (token, choice) from a send-buffer
        layout; zero for dropped choices."""
        where = jnp.where(key >= 0, key, self.num_slots * capacity)
        return _take_or_zero(rows, where)

    # -- combine ------------------------------------------------------------------
    def combine(self, expert_y, handle: JaxHandle):
        """y[t] = sum_j weights[t, j] * expert_y at the slot of (t, j)."""
        return self._combine(expert_y, handle)

    def _combine_primal(self, expert_y, handle):
        return self._combine_fwd(expert_y, handle)[0]

    def _combine_fwd(self, expert_y, handle):
        if not isinstance(handle, JaxHandle):
            problem = ValueError(f"handle must be the JaxHandle that dispatch returned, "
                                 f"got {type(handle).__name__}")
        else:
            problem = contract.combine_problem(
                expert_y, (self.local_experts, self.slots(*handle.key.shape)), handle.key)
        key = getattr(handle, "key", None)
        tokens = () if self.max_tokens_per_rank else (f"tokens {key.shape[0]}",)
        facts = () if problem else tokens + (f"k={key.shape[1]}", f"dtype {expert_y.dtype}",
                                             f"row shape {tuple(expert_y.shape[2:])}")
        self._traced.agree("moe.combine", *facts, problem=problem)
        capacity = self.capacity(*key.shape)
        with self._traced.ordered():
            back = self._to_sources(_rows(expert_y, 2), capacity)
        picked = self._gather(back, key, capacity)
        y = jnp.einsum("tk,tkw->tw", handle.weights.astype(jnp.float32),
                       picked.astype(jnp.float32))
        y = y.astype(expert_y.dtype).reshape(key.shape[:1] + expert_y.shape[2:])
        return y, (picked, handle)

    def _combine_bwd(self, saved, d_y):
        picked, handle = saved
        key, weights = handle.key, handle.weights
        capacity = self.capacity(*key.shape)
        grad = _rows(d_y, 1).astype(jnp.float32)
        d_weights = jnp.einsum("tw,tkw->tk", grad, picked.astype(jnp.float32))
        d_rows = (weights.astype(jnp.float32)[:, :, None] * grad[:, None]).astype(picked.dtype)
        send = _take_or_zero(d_rows.reshape(-1, d_rows.shape[2]), self._sources(key, capacity))
        with self._traced.ordered():
            d_expert_y = self._to_owners(send, capacity)
        d_expert_y = d_expert_y.reshape(d_expert_y.shape[:2] + d_y.shape[1:])
        return d_expert_y, JaxHandle(_float0(key), d_weights.astype(weights.dtype),
                                     _float0(handle.tokens_per_expert))
