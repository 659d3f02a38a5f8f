"""Every collective in any framework and dtype, against NumPy: one check per
collective, shared by ``tests/mpi/test_collectives_frameworks.py`` (1-4
ranks, every framework) and ``tests/test_gpu_nccl.py`` (a size-1 NCCL
communicator, the GPU frameworks).

Every rank's input comes from a generator seeded with (seed, rank), so each
rank computes the whole reference itself, in NumPy, without communicating.
Whatever only moves bytes (alltoallv, alltoall, alltoall_many,
prepare_alltoall, the ring
shifts, allgather, bcast) and max/min reductions must be bit-exact. Sums of
floats are exact at one rank; over several they are compared within the
rounding of a sum over ranks (the MPI path sums float16 and bfloat16 in
float32 and rounds once, NCCL sums them in their own type). Results must be
in the input's framework, on its device, in its dtype, and inputs must be
left as they were.

A check returns what went wrong (an empty list: nothing), so that a
multi-rank test decides together (``all_ranks``) and no rank is left waiting
in the next test's collective.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import ml_dtypes
import numpy as np
import pytest

import arrayimpl
from arrayimpl import DTYPES, ArrayImpl

CHECKED_DTYPES = ("float32", "float16", "bfloat16", "int32")
# (split_axis, concat_axis) of alltoall, on a [2, 3, 4] array
AXES = [(2, 1), (0, 0), (0, 1), (1, 0), (-1, -1)]
# layout changes do not depend on the dtype: every axis in this dtype, one in
# the others (JAX compiles each operation anew for every shape and dtype)
EVERY_AXIS_IN = "float32"


def dtypes_of(impl: ArrayImpl) -> List[str]:
    """The checked dtypes ``impl`` has: all but bfloat16 for CuPy."""
    return [d for d in CHECKED_DTYPES if not (impl.framework == "cupy" and d == "bfloat16")]


def cases(names: Sequence[str] = tuple(arrayimpl.IMPLS)) -> List[Any]:
    """``pytest.param(impl, dtype)`` for every framework in ``names`` and
    every dtype it has, GPU ones marked (and skipped where there is none)."""
    return [pytest.param(p.values[0], dtype, id=f"{p.id}-{dtype}", marks=p.marks)
            for p in arrayimpl.params(names) for dtype in dtypes_of(p.values[0])]


def rank_input(seed: int, rank: int, shape: Sequence[int], dtype: str) -> np.ndarray:
    """What ``rank`` passes: the same on every rank that computes it."""
    rng = np.random.default_rng([seed, rank])
    if dtype == "int32":
        return rng.integers(-1000, 1000, tuple(shape)).astype(np.int32)
    return (4 * rng.standard_normal(tuple(shape))).astype(DTYPES[dtype])


def transposed(impl: ArrayImpl, a: np.ndarray, dtype: str) -> Any:
    """The 2-D ``a`` in impl's framework as a transposed view, so not
    C-contiguous (JAX arrays always are)."""
    return impl.asarray(np.ascontiguousarray(a.T), dtype).T


LAYOUTS: Dict[str, Callable[[ArrayImpl, np.ndarray, str], Any]] = {
    "contiguous": lambda impl, a, dtype: impl.asarray(a, dtype), "transposed": transposed}


class Check:
    """Compares results with their NumPy references; keeps what differs."""

    def __init__(self, impl: ArrayImpl):
        self.impl = impl
        self.failures: List[str] = []

    def _result(self, what: str, got: Any, dtype: np.dtype,
                shape: Sequence[int]) -> Optional[np.ndarray]:
        """``got`` as NumPy in ``dtype``, or None (and a failure) when it is
        not an array of impl's framework and device, of that dtype and shape."""
        impl = self.impl
        if not impl.is_native(got):
            self.failures.append(f"{what}: got {type(got).__module__}."
                                 f"{type(got).__qualname__}, not a {impl.name} array")
            return None
        if impl.dtype_name(got) != dtype.name or tuple(got.shape) != tuple(shape):
            self.failures.append(f"{what}: got {impl.dtype_name(got)} {tuple(got.shape)}, "
                                 f"expected {dtype.name} {tuple(shape)}")
            return None
        return impl.to_numpy(got).astype(dtype)

    def exact(self, what: str, got: Any, want: np.ndarray) -> None:
        """``got`` holds the bits of ``want``."""
        result = self._result(what, got, want.dtype, want.shape)
        if result is None:
            return
        bits = f"u{want.dtype.itemsize}"
        differ = np.flatnonzero(np.ascontiguousarray(result).view(bits).reshape(-1)
                                != np.ascontiguousarray(want).view(bits).reshape(-1))
        if differ.size:
            first = differ[0]
            self.failures.append(
                f"{what}: {differ.size} of {want.size} elements differ from NumPy (flat "
                f"index {first}: {result.reshape(-1)[first]!r} != {want.reshape(-1)[first]!r})")

    def close(self, what: str, got: Any, want: np.ndarray, dtype: np.dtype,
              tolerance: np.ndarray) -> None:
        """``got`` (in ``dtype``) within ``tolerance`` of the float64 ``want``."""
        result = self._result(what, got, dtype, want.shape)
        if result is None:
            return
        error = np.abs(result.astype(np.float64) - want)
        if not (error <= tolerance).all():
            worst = int(np.argmax(error - tolerance))
            self.failures.append(f"{what}: off by {error.flat[worst]:.3g} (allowed "
                                 f"{tolerance.flat[worst]:.3g}) at flat index {worst}")

    def unchanged(self, what: str, x: Any, original: np.ndarray) -> None:
        """Inputs are never written."""
        if self.impl.to_numpy(x).astype(original.dtype).tobytes() != original.tobytes():
            self.failures.append(f"{what}: the input was written to")


def _send_counts(rank: int, size: int) -> np.ndarray:
    """Rows ``rank`` sends to each rank: random, with zeros (none to the next
    rank; none at all from the last of three or more)."""
    counts = np.random.default_rng([7, rank, size]).integers(0, 4, size)
    counts[rank] = max(counts[rank], 1)
    if size > 1:
        counts[(rank + 1) % size] = 0
    if size >= 3 and rank == size - 1:
        counts[:] = 0
    return counts.astype(np.int64)


def check_alltoallv(comm, impl: ArrayImpl, dtype: str, give_recv_counts: bool) -> List[str]:
    """Rows of shape [2, 3], random counts with zeros; ``recv_counts``
    given, or exchanged by commlib."""
    size, me = comm.size, comm.rank
    counts = [_send_counts(r, size) for r in range(size)]
    inputs = [rank_input(1, r, (int(counts[r].sum()), 2, 3), dtype) for r in range(size)]
    starts = [np.cumsum(c) - c for c in counts]
    want = np.concatenate([inputs[r][starts[r][me]:starts[r][me] + counts[r][me]]
                           for r in range(size)])
    want_counts = np.array([counts[r][me] for r in range(size)], np.int64)
    x = impl.asarray(inputs[me], dtype)
    y, recv = comm.alltoallv(x, counts[me], want_counts if give_recv_counts else None)
    check = Check(impl)
    check.exact("alltoallv", y, want)
    check.unchanged("alltoallv", x, inputs[me])
    if not np.array_equal(np.asarray(recv), want_counts):
        check.failures.append(f"alltoallv: recv_counts {np.asarray(recv).tolist()}, expected "
                              f"{want_counts.tolist()}")
    return check.failures


def check_alltoall(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """Every (split_axis, concat_axis) of ``AXES`` (the first but in
    ``EVERY_AXIS_IN``)."""
    size, me = comm.size, comm.rank
    check = Check(impl)
    for seed, (split, concat) in enumerate(AXES if dtype == EVERY_AXIS_IN else AXES[:1],
                                           start=10):
        shape = [2, 3, 4]
        shape[split] = 2 * size
        inputs = [rank_input(seed, r, shape, dtype) for r in range(size)]
        want = np.concatenate([np.split(inputs[r], size, axis=split)[me] for r in range(size)],
                              axis=concat)
        x = impl.asarray(inputs[me], dtype)
        what = f"alltoall(split_axis={split}, concat_axis={concat})"
        check.exact(what, comm.alltoall(x, split, concat), want)
        check.unchanged(what, x, inputs[me])
    return check.failures


def check_alltoall_many(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """``dtype`` first (alone, then packed with every other dtype impl has,
    each of its own trailing shape) in one exchange; the same started by
    ``alltoall_many_async``, two in flight together."""
    size, me = comm.size, comm.rank
    order = [dtype] + [d for d in dtypes_of(impl) if d != dtype]
    shapes = [(2 * size, 3), (size, 2, 2), (3 * size,), (size, 5)]
    inputs = [[rank_input(20 + i, r, shape, d) for r in range(size)]
              for i, (d, shape) in enumerate(zip(order, shapes))]
    wants = [np.concatenate([np.split(each[r], size)[me] for r in range(size)])
             for each in inputs]
    arrays = [impl.asarray(each[me], d) for each, d in zip(inputs, order)]
    check = Check(impl)
    for count in (1, len(arrays)):
        what = f"alltoall_many({', '.join(order[:count])})"
        for got, want in zip(comm.alltoall_many(arrays[:count]), wants):
            check.exact(what, got, want)
        first, second = (comm.alltoall_many_async(arrays[:count]) for _ in range(2))
        for pending in (second, first):
            for got, want in zip(pending.wait(), wants):
                check.exact(what.replace("many", "many_async"), got, want)
    for x, each in zip(arrays, inputs):
        check.unchanged("alltoall_many", x, each[me])
    return check.failures


def check_prepare_alltoall(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """One prepared exchange run three times, the input rewritten in place
    between runs (what a decode step does with its buffers), each result
    read from ``out``; two prepared on other buffers in flight together;
    ``alltoall_many_async(out=)``. JAX arrays (immutable) are refused."""
    size, me = comm.size, comm.rank
    check = Check(impl)
    inputs = [[rank_input(60 + run, r, (2 * size, 3), dtype) for r in range(size)]
              for run in range(3)]
    x, out = impl.asarray(inputs[0][me], dtype), impl.asarray(inputs[0][me] * 0, dtype)
    if impl.framework == "jax":
        try:
            comm.prepare_alltoall(x, out)
        except ValueError:
            return []
        return ["prepare_alltoall accepted JAX arrays, which it cannot write into"]
    prepared = comm.prepare_alltoall(x, out)
    for run, each in enumerate(inputs):
        x[...] = impl.asarray(each[me], dtype)
        prepared.start()()
        want = np.concatenate([np.split(each[r], size)[me] for r in range(size)])
        check.exact(f"prepare_alltoall, run {run}", out, want)
        check.unchanged("prepare_alltoall", x, each[me])
    others = [(impl.asarray(each[me], dtype), impl.asarray(each[me] * 0, dtype))
              for each in inputs[:2]]
    waits = [comm.prepare_alltoall(*pair).start() for pair in others]
    for wait, (_, received), each in zip(waits[::-1], others[::-1], inputs[1::-1]):
        wait()
        want = np.concatenate([np.split(each[r], size)[me] for r in range(size)])
        check.exact("prepare_alltoall, two in flight", received, want)
    received = impl.asarray(inputs[0][me] * 0, dtype)
    (got,) = comm.alltoall_many_async([x], out=received).wait()
    want = np.concatenate([np.split(inputs[2][r], size)[me] for r in range(size)])
    check.exact("alltoall_many_async(out=)", received, want)
    check.exact("alltoall_many_async(out=)'s result", got, want)
    return check.failures


def check_ring_shift(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """ring_shift by 1, -1 and 2; ring_shift_async on lanes 0 and 1 in
    flight together; contiguous and transposed inputs."""
    size, me = comm.size, comm.rank
    inputs = [rank_input(30, r, (4, 3), dtype) for r in range(size)]
    check = Check(impl)
    for layout, make in LAYOUTS.items():
        x = make(impl, inputs[me], dtype)
        for shift in (1, -1, 2):
            check.exact(f"ring_shift(shift={shift}, {layout})", comm.ring_shift(x, shift),
                        inputs[(me - shift) % size])
        up = comm.ring_shift_async(x, 1, lane=0)
        down = comm.ring_shift_async(x, -1, lane=1)
        check.exact(f"ring_shift_async(shift=-1, lane=1, {layout})", down.wait(),
                    inputs[(me + 1) % size])
        check.exact(f"ring_shift_async(shift=1, lane=0, {layout})", up.wait(),
                    inputs[(me - 1) % size])
        check.unchanged(f"ring_shift ({layout})", x, inputs[me])
    return check.failures


def check_allgather(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """Axes 0, 1 and -1 (1 but in ``EVERY_AXIS_IN``); contiguous and
    transposed inputs."""
    inputs = [rank_input(40, r, (4, 3), dtype) for r in range(comm.size)]
    check = Check(impl)
    for layout, make in LAYOUTS.items():
        x = make(impl, inputs[comm.rank], dtype)
        for axis in (0, 1, -1) if dtype == EVERY_AXIS_IN else (1,):
            check.exact(f"allgather(axis={axis}, {layout})", comm.allgather(x, axis),
                        np.concatenate(inputs, axis=axis))
        check.unchanged(f"allgather ({layout})", x, inputs[comm.rank])
    return check.failures


def check_allreduce(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """max and min bit-exact; sum exact for integers and at one rank, else
    within ``size`` roundings of the float64 sum."""
    inputs = [rank_input(50, r, (5, 4), dtype) for r in range(comm.size)]
    stacked = np.stack(inputs).astype(np.float64)
    kind = inputs[0].dtype
    x = impl.asarray(inputs[comm.rank], dtype)
    check = Check(impl)
    for op in ("max", "min"):
        want = getattr(np, op)(stacked, axis=0).astype(kind)
        check.exact(f"allreduce({op})", comm.allreduce(x, op), want)
    total = comm.allreduce(x, "sum")
    if dtype == "int32" or comm.size == 1:
        check.exact("allreduce(sum)", total, stacked.sum(axis=0).astype(kind))
    else:
        tolerance = comm.size * float(ml_dtypes.finfo(kind).eps) * np.abs(stacked).sum(axis=0)
        check.close("allreduce(sum)", total, stacked.sum(axis=0), kind, tolerance)
    check.unchanged("allreduce", x, inputs[comm.rank])
    return check.failures


def check_bcast(comm, impl: ArrayImpl, dtype: str) -> List[str]:
    """From the first and the last rank; the others pass zeros of root's
    shape and dtype, whose framework the result takes."""
    check = Check(impl)
    for root in sorted({0, comm.size - 1}):
        sent = rank_input(60, root, (3, 5), dtype)
        mine = sent if comm.rank == root else np.zeros_like(sent)
        x = impl.asarray(mine, dtype)
        check.exact(f"bcast(root={root})", comm.bcast(x, root), sent)
        check.unchanged(f"bcast(root={root})", x, mine)
    return check.failures


# collective -> check(comm, impl, dtype): what the test files parametrize over
CHECKS: Dict[str, Callable[[Any, ArrayImpl, str], List[str]]] = {
    "alltoallv": functools.partial(check_alltoallv, give_recv_counts=False),
    "alltoallv-recv_counts": functools.partial(check_alltoallv, give_recv_counts=True),
    "alltoall": check_alltoall,
    "alltoall_many": check_alltoall_many,
    "prepare_alltoall": check_prepare_alltoall,
    "ring_shift": check_ring_shift,
    "allgather": check_allgather,
    "allreduce": check_allreduce,
    "bcast": check_bcast,
}
