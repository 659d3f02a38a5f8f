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
to local expert l (in token order; zero rows where a source sent fewer).
Combine sends the same rows back and gathers each (token, choice) from its
slot. The routing state is the traced ``key`` [T, k] (int32 row of the send
buffer, -1 for a dropped or absent choice): nothing is kept on the host.

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
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from commlib.errors import CollectiveMismatchError
from commlib.moe.stats import DispatchStats

from .jax_collectives import traced

__all__ = ["Dispatcher"]


class _Summed:
    """A communicator stand-in for ``DispatchStats.gather`` whose allreduce
    is the identity: the counts the dispatch callback gets are already the
    sums over ranks."""

    def __init__(self, comm):
        self.size, self.topology = comm.size, comm.topology

    @staticmethod
    def allreduce(local: np.ndarray) -> np.ndarray:
        return local


def _order_by(group, count: int):
    """The stable permutation that sorts ``group`` (values 0..count): one
    sort of a packed int32 key (group * n + position) where it fits, as XLA
    sorts one operand much faster than a key with a payload."""
    n = group.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    if (count + 1) * max(n, 1) < 2 ** 31:
        return jnp.sort(group * n + iota) % max(n, 1)
    return jax.lax.sort((group, iota), num_keys=1, is_stable=True)[1]


def _place_in_group(grouped, iota):
    """Each element's index within its run of equal values in the sorted
    ``grouped`` (a running max of the runs' starts: no search loop)."""
    starts = jnp.concatenate([jnp.ones(min(1, grouped.shape[0]), bool),
                              grouped[1:] != grouped[:-1]])
    return iota - jax.lax.cummax(jnp.where(starts, iota, 0))


def _rows(a, leading: int):
    """``a`` with its trailing (row) axes flattened to one."""
    return a.reshape(a.shape[:leading] + (math.prod(a.shape[leading:]),))


class Dispatcher:
    """Expert-parallel dispatch and combine for JAX arrays, jit-able and
    differentiable (``x``, ``weights`` and ``expert_y`` get gradients).

    ``dispatch(x, experts, weights) -> (expert_x, key)``: ``x`` [T, H...],
    ``experts`` [T, k] integers (-1: no expert), ``weights`` [T, k];
    ``expert_x`` is [local_experts, size * capacity, H...] in x's dtype,
    zero where a slot is empty (``slots(T, k)`` gives the second size).
    ``combine(expert_y, weights, key) -> y`` [T, H'...] in expert_y's dtype:
    ``y[t] = sum_j weights[t, j] * expert_y`` at the slot of (t, j), summed
    in float32; a dropped choice contributes 0. ``combine`` weighs by the
    ``weights`` it is given (pass the dispatch's); d weights[t, j] is
    ``<dy[t], expert_y row of (t, j)>`` (0 for dropped choices), as in
    ``commlib.moe.Dispatcher.combine_backward``.

    Capacity and drops as in ``commlib.moe``: each expert takes at most
    ``ceil(T * k / E * capacity_factor)`` assignments from each source rank;
    ``drop_policy="probs"`` keeps the heaviest, ``"position"`` the earliest,
    ties to the earlier (token, choice). T, k, x's row shape and dtype must
    be the same on every rank (the padded exchange needs one capacity).

    ``hierarchical``: accepted (and checked like the core's), but the flat
    exchange runs. A fixed-capacity exchange moves the same padded chunk
    between every pair of ranks, so a two-hop route has no duplicate rows to
    save; the results are identical. ``keep``: unused, deprecated (there is
    no registry of dispatches any more); accepted for compatibility.

    ``stats``: the running ``DispatchStats`` of every dispatch that ran
    (global, the same on every rank): ``tokens_per_expert`` and ``dropped``
    as in the core; ``traffic`` counts the bytes that move, the padded
    ``local_experts * capacity`` rows per pair of ranks. Under
    ``jax.checkpoint`` a recomputed dispatch counts again.
    """

    def __init__(self, comm, num_experts: int, capacity_factor: float,
                 drop_policy: str = "probs", hierarchical: bool = False, keep: int = 64):
        from commlib import moe

        # the core checks the arguments, and that every rank passed the same
        self.core = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                                   drop_policy=drop_policy, hierarchical=hierarchical)
        if capacity_factor is None:
            raise ValueError("JAX shapes are static: give a capacity_factor (drop-and-pad)")
        self.comm, self.keep = comm, keep
        self.num_experts, self.local_experts = num_experts, self.core.local_experts
        self._traced = traced(comm)
        self._stats = DispatchStats.zeros(num_experts, comm.size)
        self.dispatch = jax.custom_vjp(self._dispatch)
        self.dispatch.defvjp(self._dispatch_fwd, self._dispatch_bwd)
        self.combine = jax.custom_vjp(self._combine)
        self.combine.defvjp(self._combine_fwd, self._combine_bwd)

    @property
    def stats(self) -> DispatchStats:
        return self._stats

    def capacity(self, tokens: int, k: int) -> int:
        """Slots per (source rank, expert)."""
        return self.core._capacity(tokens, k)

    def slots(self, tokens: int, k: int) -> int:
        """Rows per local expert in the padded layout."""
        return self.comm.size * self.capacity(tokens, k)

    # -- trace-time checks -------------------------------------------------------
    def _dispatch_problem(self, x, experts, weights) -> Optional[Exception]:
        try:
            if x.ndim < 1:
                raise ValueError("x must have one row per token, got a scalar")
            if experts.ndim != 2 or experts.shape[0] != x.shape[0]:
                raise ValueError(f"experts must be [tokens, k] with {x.shape[0]} rows like x, "
                                 f"got shape {tuple(experts.shape)}")
            if tuple(weights.shape) != tuple(experts.shape):
                raise ValueError(f"weights must have the shape of experts "
                                 f"{tuple(experts.shape)}, got {tuple(weights.shape)}")
            if not jnp.issubdtype(experts.dtype, jnp.integer):
                raise ValueError(f"experts must be integers, got {experts.dtype}")
            if not isinstance(experts, jax.core.Tracer) and experts.size:  # known now
                known = np.asarray(experts)
                self._check_range(int(known.min()), int(known.max()))
        except ValueError as error:
            return error
        return None

    def _check_range(self, low: int, high: int) -> None:
        if low < -1 or high >= self.num_experts:
            raise ValueError(f"expert indices must lie in [-1, {self.num_experts}) "
                             f"(-1: no expert), got values from {low} to {high}")

    def _combine_problem(self, expert_y, weights, key) -> Optional[Exception]:
        try:
            if key.ndim != 2 or not jnp.issubdtype(key.dtype, jnp.integer):
                raise ValueError(f"key must be the [tokens, k] integer array dispatch "
                                 f"returned, got {key.dtype} {tuple(key.shape)}")
            if tuple(weights.shape) != tuple(key.shape):
                raise ValueError(f"weights must be [tokens, k] {tuple(key.shape)} like the "
                                 f"dispatch's, got {tuple(weights.shape)}")
            want = (self.local_experts, self.slots(*key.shape))
            if tuple(expert_y.shape[:2]) != want:
                raise ValueError(f"expert_y must be [local_experts, slots, ...] with "
                                 f"{want} leading, like expert_x; got {tuple(expert_y.shape)}")
        except ValueError as error:
            return error
        return None

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
        per expert, smallest and largest id). Fixed sizes, no host reads."""
        count = self.num_experts
        flat = experts.reshape(-1).astype(jnp.int32)
        n = flat.shape[0]
        iota = jnp.arange(n, dtype=jnp.int32)
        valid = (flat >= 0) & (flat < count)
        group = jnp.where(valid, flat, count)  # absent and bad ids sort last
        if self.core.drop_policy == "probs":  # within an expert heaviest first, ties by position
            by_weight = jax.lax.sort((-weights.reshape(-1).astype(jnp.float32), iota),
                                     num_keys=1, is_stable=True)[1]
            order = by_weight[_order_by(group[by_weight], count)]
        else:
            order = _order_by(group, count)
        grouped = group[order]
        place = _place_in_group(grouped, iota)
        kept = jnp.zeros(n, bool).at[order].set((place < capacity) & (grouped < count))
        if self.core.drop_policy == "probs":  # slots in token order among the kept
            group = jnp.where(kept, flat, count)
            order = _order_by(group, count)
            place = _place_in_group(group[order], iota)
        slot = jnp.zeros(n, jnp.int32).at[order].set(place)
        key = jnp.where(kept, flat * capacity + slot, -1).reshape(experts.shape)
        tally = jnp.zeros(2 * count + 2, jnp.int32)
        nowhere = 2 * count + 2  # past the end: mode="drop" skips it
        tally = tally.at[jnp.where(kept, flat, nowhere)].add(1, mode="drop")
        tally = tally.at[jnp.where(valid & ~kept, flat + count, nowhere)].add(1, mode="drop")
        if n:
            extremes = jnp.stack([jnp.min(experts), jnp.max(experts)]).astype(jnp.int32)
        else:
            extremes = jnp.array([-1, -1], jnp.int32)
        return key, tally.at[2 * count:].set(extremes)

    def _record(self, row_bytes: int, capacity: int):
        """The host side of a dispatch: every rank's counts [P, 2E + 2] in,
        the same verdict and the same stats on every rank."""
        count, size = self.num_experts, self.comm.size

        def record(table):
            table = np.asarray(table, np.int64)
            lines = []
            for rank, (low, high) in enumerate(table[:, 2 * count:]):
                try:
                    self._check_range(int(low), int(high))
                except ValueError as error:
                    lines.append((rank, str(error)))
            if lines:
                raise CollectiveMismatchError(
                    "moe.dispatch was rejected by rank(s) "
                    + ", ".join(str(rank) for rank, _ in lines) + ":\n  "
                    + "\n  ".join(f"rank {rank}: {line}" for rank, line in lines))
            traffic = np.full((size, size), self.local_experts * capacity * row_bytes, np.int64)
            self._stats = self._stats + DispatchStats.gather(
                _Summed(self.comm), table[:, :count].sum(axis=0),
                table[:, count:2 * count].sum(axis=0), traffic)
            return np.zeros((), np.uint8)
        return record

    # -- dispatch -----------------------------------------------------------------
    def _dispatch(self, x, experts, weights):
        return self._dispatch_fwd(x, experts, weights)[0]

    def _dispatch_fwd(self, x, experts, weights):
        problem = self._dispatch_problem(x, experts, weights)
        facts = () if problem else (f"tokens {x.shape[0]}", f"k={experts.shape[1]}",
                                    f"row shape {tuple(x.shape[1:])}", f"dtype {x.dtype}")
        self._traced.agree("moe.dispatch", *facts, problem=problem)
        tokens, k = experts.shape
        capacity = self.capacity(tokens, k)
        rows = _rows(x, 1)
        key, counts = self._route(experts, weights, capacity)
        send = jnp.take(rows, self._sources(key, capacity) // k, axis=0, mode="fill",
                        fill_value=0)  # empty slots: past the end, zero
        record = self._record(x.dtype.itemsize * rows.shape[1], capacity)
        # the counts go with this dispatch's rows: JAX would otherwise hoist a
        # loop-invariant count exchange out of a scan, and count it once
        counts, send = jax.lax.optimization_barrier((counts, send))
        with self._traced.ordered():
            table = self._traced.alltoall(jnp.broadcast_to(counts, (self.comm.size,)
                                                           + counts.shape))
            verdict = io_callback(record, jax.ShapeDtypeStruct((), jnp.uint8), table)
            send, _ = jax.lax.optimization_barrier((send, verdict))  # rows move after it
            expert_x = self._to_owners(send, capacity)
        expert_x = expert_x.reshape(expert_x.shape[:2] + x.shape[1:])
        return (expert_x, key), (key, weights)

    def _dispatch_bwd(self, saved, cotangents):
        key, weights = saved
        d_expert_x = cotangents[0]
        capacity = self.capacity(*key.shape)
        with self._traced.ordered():
            back = self._to_sources(_rows(d_expert_x, 2), capacity)
        picked = self._gather(back, key, capacity).astype(jnp.float32)
        dx = picked.sum(axis=1).astype(d_expert_x.dtype)
        return (dx.reshape(key.shape[:1] + d_expert_x.shape[2:]),
                np.zeros(key.shape, jax.dtypes.float0), jnp.zeros_like(weights))

    def _sources(self, key, capacity: int):
        """For each send-buffer row [E * capacity], its (token, choice) as
        t * k + j; T * k (past the end) for an empty slot. A scatter of
        indices, so the rows themselves move by a gather."""
        size = key.size
        where = jnp.where(key >= 0, key, self.num_experts * capacity).reshape(-1)
        return jnp.full(self.num_experts * capacity, size, jnp.int32).at[where].set(
            jnp.arange(size, dtype=jnp.int32), mode="drop", unique_indices=True)

    def _gather(self, rows, key, capacity: int):
        """The rows [T, k, W] of each (token, choice) from a send-buffer
        layout; zero for dropped choices."""
        where = jnp.where(key >= 0, key, self.num_experts * capacity)
        return jnp.take(rows, where, axis=0, mode="fill", fill_value=0)

    # -- combine ------------------------------------------------------------------
    def _combine(self, expert_y, weights, key):
        return self._combine_fwd(expert_y, weights, key)[0]

    def _combine_fwd(self, expert_y, weights, key):
        problem = self._combine_problem(expert_y, weights, key)
        facts = () if problem else (f"key {tuple(key.shape)}", f"dtype {expert_y.dtype}",
                                    f"row shape {tuple(expert_y.shape[2:])}")
        self._traced.agree("moe.combine", *facts, problem=problem)
        capacity = self.capacity(*key.shape)
        with self._traced.ordered():
            back = self._to_sources(_rows(expert_y, 2), capacity)
        picked = self._gather(back, key, capacity)
        y = jnp.einsum("tk,tkw->tw", weights.astype(jnp.float32), picked.astype(jnp.float32))
        y = y.astype(expert_y.dtype).reshape(key.shape[:1] + expert_y.shape[2:])
        return y, (picked, weights, key)

    def _combine_bwd(self, saved, d_y):
        picked, weights, key = saved
        capacity = self.capacity(*key.shape)
        grad = _rows(d_y, 1).astype(jnp.float32)
        d_weights = jnp.einsum("tw,tkw->tk", grad, picked.astype(jnp.float32))
        d_rows = (weights.astype(jnp.float32)[:, :, None] * grad[:, None]).astype(picked.dtype)
        send = jnp.take(d_rows.reshape(-1, d_rows.shape[2]), self._sources(key, capacity),
                        axis=0, mode="fill", fill_value=0)
        with self._traced.ordered():
            d_expert_y = self._to_owners(send, capacity)
        d_expert_y = d_expert_y.reshape(d_expert_y.shape[:2] + d_y.shape[1:])
        return d_expert_y, d_weights.astype(weights.dtype), np.zeros(key.shape,
                                                                      jax.dtypes.float0)
