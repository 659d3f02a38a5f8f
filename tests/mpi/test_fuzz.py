"""Hypothesis over every collective: equality with NumPy references built
from every rank's reproducible input, and conservation."""

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis_ranks import given_on_every_rank

from conftest import all_ranks, same_on_all_ranks

# hypothesis over collectives at even, odd and two-host sizes
WORLD_SIZES = (2, 3, 4)

DTYPES = [np.int8, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64,
          np.bool_, ml_dtypes.bfloat16]


def rank_input(rank, shape, dtype, seed):
    rng = np.random.default_rng([seed, rank])
    return rng.integers(0, 4, size=shape).astype(dtype)


def draw_common(data, size, max_dims=3):
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = tuple(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=max_dims)))
    seed = data.draw(st.integers(0, 2**16))
    return dtype, shape, seed


@given_on_every_rank(data=st.data())
def test_alltoall(comm, data):
    dtype, shape, seed = draw_common(data, comm.size)
    split_axis = data.draw(st.integers(0, len(shape) - 1))
    concat_axis = data.draw(st.integers(0, len(shape) - 1))
    shape = list(shape)
    shape[split_axis] *= comm.size
    same_on_all_ranks((np.dtype(dtype).name, shape, seed, split_axis, concat_axis))
    inputs = [rank_input(r, shape, dtype, seed) for r in range(comm.size)]
    y = comm.alltoall(inputs[comm.rank], split_axis, concat_axis)
    expected = np.concatenate([np.split(inputs[r], comm.size, axis=split_axis)[comm.rank]
                               for r in range(comm.size)], axis=concat_axis)
    total = comm.allreduce(np.array([y.size]))[0]
    assert all_ranks(y.dtype == expected.dtype and y.tobytes() == expected.tobytes()
                     and total == sum(i.size for i in inputs))


@given_on_every_rank(data=st.data())
def test_allgather(comm, data):
    dtype, shape, seed = draw_common(data, comm.size)
    axis = data.draw(st.integers(0, len(shape) - 1))
    same_on_all_ranks((np.dtype(dtype).name, shape, seed, axis))
    inputs = [rank_input(r, shape, dtype, seed) for r in range(comm.size)]
    y = comm.allgather(inputs[comm.rank], axis=axis)
    assert all_ranks(y.tobytes() == np.concatenate(inputs, axis=axis).tobytes())


@given_on_every_rank(data=st.data())
def test_allreduce(comm, data):
    dtype, shape, seed = draw_common(data, comm.size)
    op = data.draw(st.sampled_from(["sum", "max", "min"]))
    same_on_all_ranks((np.dtype(dtype).name, shape, seed, op))
    inputs = [rank_input(r, shape, dtype, seed) for r in range(comm.size)]
    y = comm.allreduce(inputs[comm.rank], op)
    stacked = np.stack([i.astype(np.float64) for i in inputs])
    reduce = {"sum": np.sum, "max": np.max, "min": np.min}[op]
    expected = reduce(stacked, axis=0)
    if np.dtype(dtype) == np.bool_:  # or for sum and max, and for min
        expected = expected > 0
    assert all_ranks(y.shape == tuple(shape) and np.array_equal(
        y.astype(np.float64), expected.astype(dtype).astype(np.float64)))


@given_on_every_rank(data=st.data())
def test_bcast_and_ring_shift(comm, data):
    dtype, shape, seed = draw_common(data, comm.size)
    root = data.draw(st.integers(0, comm.size - 1))
    shift = data.draw(st.integers(-5, 5))
    same_on_all_ranks((np.dtype(dtype).name, shape, seed, root, shift))
    inputs = [rank_input(r, shape, dtype, seed) for r in range(comm.size)]
    b = comm.bcast(inputs[comm.rank] if comm.rank == root else None, root=root)
    s = comm.ring_shift(inputs[comm.rank], shift)
    assert all_ranks(b.tobytes() == inputs[root].tobytes()
                     and s.tobytes() == inputs[(comm.rank - shift) % comm.size].tobytes())
