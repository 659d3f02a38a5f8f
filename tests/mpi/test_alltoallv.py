"""alltoallv against mpi4py's own Alltoallv, at any world size."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis_ranks import given_on_every_rank

import commlib

from conftest import all_ranks, raises_everywhere, reference_alltoallv, same_on_all_ranks

# counts at any world size; 1 alone; 4 across two hosts
WORLD_SIZES = (1, 2, 3, 4)

DTYPES = [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
          np.float16, np.float32, np.float64, np.complex64, np.bool_, ml_dtypes.bfloat16,
          ml_dtypes.float8_e4m3fn]


def rows_for(rank, counts, trailing, dtype, seed=0):
    """Rows that say where they came from, so misplaced rows are caught."""
    rng = np.random.default_rng([seed, rank])
    values = rng.integers(0, 100, size=(int(np.sum(counts)),) + trailing)
    return values.astype(dtype)


def counts_matrix(size, seed, high=5):
    """counts[i, j]: rows rank i sends to rank j (the same on every rank)."""
    return np.random.default_rng(seed).integers(0, high, size=(size, size))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_mpi4py_for_every_dtype(comm, dtype):
    send = counts_matrix(comm.size, seed=1)[comm.rank]
    x = rows_for(comm.rank, send, (3,), dtype)
    y, recv = comm.alltoallv(x, send)
    expected = reference_alltoallv(x, send)
    assert all_ranks(y.dtype == expected.dtype and y.tobytes() == expected.tobytes())
    assert recv.dtype == np.int64
    assert recv.tolist() == counts_matrix(comm.size, seed=1)[:, comm.rank].tolist()


@pytest.mark.parametrize("trailing", [(), (1,), (4, 3), (2, 0)])
def test_trailing_shapes(comm, trailing):
    send = counts_matrix(comm.size, seed=2)[comm.rank]
    x = rows_for(comm.rank, send, trailing, np.float32)
    y, _ = comm.alltoallv(x, send)
    expected = reference_alltoallv(x, send)
    assert all_ranks(y.shape == expected.shape and np.array_equal(y, expected))


def test_given_recv_counts_skip_the_exchange(comm):
    matrix = counts_matrix(comm.size, seed=3)
    x = rows_for(comm.rank, matrix[comm.rank], (2,), np.int32)
    y, recv = comm.alltoallv(x, matrix[comm.rank], recv_counts=matrix[:, comm.rank])
    assert all_ranks(np.array_equal(y, reference_alltoallv(x, matrix[comm.rank])))
    assert recv.tolist() == matrix[:, comm.rank].tolist()


def test_every_rank_sends_nothing(comm):
    x = np.zeros((0, 4), np.float32)
    y, recv = comm.alltoallv(x, [0] * comm.size)
    assert y.shape == (0, 4) and recv.tolist() == [0] * comm.size


def test_non_contiguous_input(comm):
    send = counts_matrix(comm.size, seed=4)[comm.rank]
    base = rows_for(comm.rank, send, (6,), np.float64)
    x = base[:, ::2]
    y, _ = comm.alltoallv(x, send)
    assert all_ranks(np.array_equal(y, reference_alltoallv(np.ascontiguousarray(x), send)))


def test_input_is_not_written(comm):
    send = counts_matrix(comm.size, seed=5)[comm.rank]
    x = rows_for(comm.rank, send, (2,), np.int64)
    before = x.copy()
    y, _ = comm.alltoallv(x, send)
    y[...] = -1
    assert all_ranks(np.array_equal(x, before))


@given_on_every_rank(data=st.data())
def test_property_conservation_and_reference(comm, data):
    size = comm.size
    matrix = np.array(data.draw(st.lists(
        st.lists(st.integers(0, 6), min_size=size, max_size=size),
        min_size=size, max_size=size)), dtype=np.int64)
    dtype = data.draw(st.sampled_from([np.uint8, np.int32, np.float64, np.bool_,
                                       np.float16, ml_dtypes.bfloat16]))
    trailing = tuple(data.draw(st.lists(st.integers(0, 3), max_size=2)))
    same_on_all_ranks((matrix.tolist(), np.dtype(dtype).name, trailing))
    send = matrix[comm.rank]
    x = rows_for(comm.rank, send, trailing, dtype, seed=int(matrix.sum()))
    y, recv = comm.alltoallv(x, send)
    expected = reference_alltoallv(x, send)
    ok = (recv.tolist() == matrix[:, comm.rank].tolist()
          and y.shape == expected.shape and y.tobytes() == expected.tobytes())
    # conservation: every row sent arrives exactly once
    sent_total = comm.allreduce(np.array([x.shape[0]]))[0]
    received_total = comm.allreduce(np.array([y.shape[0]]))[0]
    assert all_ranks(ok and sent_total == received_total == matrix.sum())


# -- bad input: an error on every rank, naming the rank at fault -------------

def _bad_on_last_rank(comm, good, bad):
    return bad if comm.rank == comm.size - 1 else good


@pytest.mark.parametrize("case, message", [
    ("too_few", "one entry per rank"),
    ("negative", "non-negative"),
    ("float", "must be integers"),
    ("wrong_sum", "sums to"),
    ("scalar", "scalar"),
    ("not_array", "sequence of"),
])
def test_bad_counts_raise_on_every_rank(comm, case, message):
    size = comm.size
    good_counts = [1] * size
    x = np.ones((size, 2), np.float32)
    bad = {
        "too_few": (x, [1] * (size + 1)),
        "negative": (x, [size + 1] + [-1] + [1] * (size - 2) if size > 1 else [-1]),
        "float": (x, [1.5] * size),
        "wrong_sum": (x, [2] * size),
        "scalar": (np.float32(1.0), good_counts),
        "not_array": (x, object()),
    }[case]
    args = _bad_on_last_rank(comm, (x, good_counts), bad)
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: comm.alltoallv(*args), match=message)
    assert f"rank {size - 1}" in str(error)
    assert isinstance(error, ValueError)


def test_ranks_disagreeing_on_dtype_raise_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    dtype = np.float64 if comm.rank == 0 else np.float32
    x = np.ones((comm.size, 2), dtype)
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: comm.alltoallv(x, [1] * comm.size), match="disagree")
    assert "rank 0: alltoallv, dtype float64" in str(error)


def test_host_rows_on_one_rank_and_cuda_rows_on_another_raise_everywhere(comm, monkeypatch):
    """They travel differently (host MPI messages, NCCL or staged chunks),
    so they would never meet: found at the count exchange instead."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    import commlib.communicator as communicator
    from commlib.dlpack import Native

    if comm.rank == 0:  # rank 0's rows claim to be on a GPU; nothing moves before the check
        def on_gpu(x):
            return Native(x, x.dtype, True, "cupy", lambda y: y)
        monkeypatch.setattr(communicator, "unwrap", on_gpu)
        monkeypatch.setattr(comm, "_transport", lambda on_device: comm._host)
    x = np.ones((comm.size, 2), np.float32)
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: comm.alltoallv(x, [1] * comm.size), match="disagree")
    assert "rank 0: alltoallv, dtype float32, row shape (2,), CUDA arrays" in str(error)
    assert "host arrays" in str(error)


def test_ranks_disagreeing_on_row_shape_raise_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones((comm.size, 2 + (comm.rank == 1)), np.float32)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: comm.alltoallv(x, [1] * comm.size), match="row shape (3,)")


def test_bad_recv_counts_are_rejected_locally(comm):
    x = np.ones((comm.size, 2), np.float32)
    raises_everywhere(ValueError, lambda: comm.alltoallv(x, [1] * comm.size,
                                                         recv_counts=[-1] * comm.size),
                      match="recv_counts must be non-negative")


def test_async_results_equal_mpi4py_whatever_order_the_waits_come_in(comm):
    """Three exchanges in flight at once (a count exchange for each, then the
    payloads), waited on in reverse: each gets its own rows."""
    pendings, expected = [], []
    for seed in (3, 4, 5):
        send = counts_matrix(comm.size, seed=seed, high=40)[comm.rank]
        x = rows_for(comm.rank, send, (16,), np.float32, seed=seed)
        pendings.append(comm.alltoallv_async(x, send))
        expected.append(reference_alltoallv(x, send))
        assert pendings[-1].recv_counts.tolist() == \
            counts_matrix(comm.size, seed=seed, high=40)[:, comm.rank].tolist()
    results = [p.wait() for p in reversed(pendings)][::-1]
    assert all_ranks(all(r.tobytes() == e.tobytes() for r, e in zip(results, expected)))
    with pytest.raises(RuntimeError, match="already waited on"):
        pendings[0].wait()


def test_async_transfer_progresses_while_the_caller_computes(comm, monkeypatch):
    """A 4 MiB per peer exchange started, then a busy loop that never enters
    MPI: the progress thread (forced on: this machine has no spare core)
    moves the bytes, so the wait finds them there (without it the wait would
    take the transfer's whole time)."""
    import time
    monkeypatch.setenv("COMMLIB_PROGRESS_THREAD", "1")
    x = np.ones((comm.size * 1024, 1024), np.float32)
    pending = comm.alltoallv_async(x, [1024] * comm.size, [1024] * comm.size)
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        np.dot(np.ones((64, 64)), np.ones((64, 64)))  # releases the GIL, as kernels do
    start = time.perf_counter()
    y = pending.wait()
    waited = time.perf_counter() - start
    assert all_ranks(y.shape == x.shape and bool((y == 1).all()))
    # no timing assertion (noisy machines); the waits are reported for the record
    print(f"rank {comm.rank}: waited {waited * 1e3:.2f} ms after 500 ms of compute")


def test_async_dropped_unwaited_is_an_error_at_the_next_call_not_a_hang():
    c = commlib.init(timeout=60)
    try:
        x = np.ones((c.size * 2, 4), np.float32)

        def forget_then_call():
            pending = c.alltoallv_async(x, [2] * c.size, [2] * c.size)
            if c.rank == 0:
                del pending  # never waited on
            else:
                pending.wait()  # completes, or hears of rank 0 giving up
            c.alltoallv(x, [2] * c.size)
        error = raises_everywhere(commlib.CommlibError, forget_then_call)
        assert "never waited on" in str(error), str(error)
    finally:
        c.free()
