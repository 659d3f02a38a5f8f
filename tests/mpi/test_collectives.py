"""alltoall, ring_shift, allgather, allreduce, bcast, barrier against NumPy
references built from every rank's (reproducible) input."""

import ml_dtypes
import numpy as np
import pytest

import commlib

from conftest import all_ranks, raises_everywhere

# every collective alone, in pairs, odd and across two hosts
WORLD_SIZES = (1, 2, 3, 4)


def local_input(rank, shape, dtype=np.int64):
    return (np.arange(int(np.prod(shape))).reshape(shape) + 1000 * rank).astype(dtype)


@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0), (2, 1), (-1, -1)])
def test_alltoall_matches_slicing(comm, split_axis, concat_axis):
    size = comm.size
    shape = [2, 3, 4]
    shape[split_axis] = 2 * size
    inputs = [local_input(r, shape) for r in range(size)]
    y = comm.alltoall(inputs[comm.rank], split_axis, concat_axis)
    chunks = [np.split(inputs[r], size, axis=split_axis)[comm.rank] for r in range(size)]
    assert all_ranks(np.array_equal(y, np.concatenate(chunks, axis=concat_axis)))


def test_alltoall_rejects_indivisible_axis(comm):
    if comm.size == 1:
        pytest.skip("every length divides by 1")
    x = np.zeros((comm.size + 1, 2))
    raises_everywhere(ValueError, lambda: comm.alltoall(x), match=f"multiple of {comm.size}")


def test_alltoall_rejects_bad_axis(comm):
    raises_everywhere(ValueError, lambda: comm.alltoall(np.zeros((comm.size, 2)), split_axis=2),
                      match="out of range")


@pytest.mark.parametrize("shift", [1, -1, 2, 0, 7])
def test_ring_shift(comm, shift):
    y = comm.ring_shift(local_input(comm.rank, (3, 2)), shift)
    source = (comm.rank - shift) % comm.size
    assert all_ranks(np.array_equal(y, local_input(source, (3, 2))))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_allgather(comm, axis):
    y = comm.allgather(local_input(comm.rank, (2, 3)), axis=axis)
    expected = np.concatenate([local_input(r, (2, 3)) for r in range(comm.size)], axis=axis)
    assert all_ranks(np.array_equal(y, expected))


@pytest.mark.parametrize("op, reduce", [("sum", np.sum), ("prod", np.prod),
                                        ("max", np.max), ("min", np.min)])
@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_allreduce(comm, op, reduce, dtype):
    def value(r):
        return (np.arange(6).reshape(2, 3) % 3 + r + 1).astype(dtype)
    y = comm.allreduce(value(comm.rank), op)
    stacked = np.stack([value(r).astype(np.float64) for r in range(comm.size)])
    expected = reduce(stacked, axis=0).astype(dtype)
    assert all_ranks(y.dtype == np.dtype(dtype) and np.array_equal(y, expected))


def test_allreduce_bool_is_logical(comm):
    x = np.array([comm.rank == 0, True, False])
    any_, all_ = comm.allreduce(x, "sum"), comm.allreduce(x, "prod")
    assert all_ranks(any_.tolist() == [True, True, False]
                     and all_.tolist() == [comm.size == 1, True, False])


def test_allreduce_rejects_unknown_op(comm):
    raises_everywhere(ValueError, lambda: comm.allreduce(np.ones(2), "mean"),
                      match="sum, prod, max, min")


@pytest.mark.parametrize("root_choice", ["first", "last"])
def test_bcast(comm, root_choice):
    root = 0 if root_choice == "first" else comm.size - 1
    value = local_input(root, (2, 2), np.float32)
    mine = value if comm.rank == root else (None if comm.rank % 2 else np.zeros((2, 2), np.float32))
    y = comm.bcast(mine, root=root)
    assert all_ranks(np.array_equal(y, value) and y.dtype == np.float32)


def test_bcast_rejects_bad_root(comm):
    raises_everywhere(ValueError, lambda: comm.bcast(np.ones(1), root=comm.size),
                      match="not a rank")


def test_barrier(comm):
    comm.barrier()


def test_split_keeps_topology_and_works(comm):
    world = commlib.init(ranks_per_node=1)
    sub = world.split(comm.rank % 2, key=-comm.rank)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    try:
        assert sub.size == len(members)
        assert sub.rank == sorted(members, reverse=True).index(comm.rank)
        assert sub.topology.num_nodes == sub.size
        y = sub.allgather(np.array([comm.rank]))
        assert all_ranks(y.tolist() == sorted(members, reverse=True))
    finally:
        sub.free()
        world.free()


def test_ring_shift_async_keeps_its_send_buffer_until_wait(comm, monkeypatch):
    """A transport may read the send buffer long after the call returns
    (NCCL reads it on its stream). Stand in for one: the transfer starts
    only at wait(), from a weak reference to the buffer it was handed. A
    non-contiguous input makes commlib send a copy, which must live until
    then."""
    import gc
    import weakref

    start = comm._host.start_sendrecv

    def deferred(send, dest, out, source):
        handed = weakref.ref(send)

        def wait():
            gc.collect()
            alive = handed()
            assert alive is not None, "the send buffer was freed before the transfer"
            start(alive, dest, out, source)()
        return wait

    monkeypatch.setattr(comm._host, "start_sendrecv", deferred)
    x = (np.arange(24.0).reshape(4, 6) + comm.rank)[:, ::2]  # strided: sent as a copy
    pending = comm.ring_shift_async(x)
    gc.collect()
    got = pending.wait()
    expected = np.arange(24.0).reshape(4, 6)[:, ::2] + (comm.rank - 1) % comm.size
    assert all_ranks(np.array_equal(got, expected))


def test_a_shift_dropped_before_its_wait_fails_the_communicator_and_keeps_its_buffers(comm):
    """An exception between ring_shift_async and wait() drops the pending
    shift while its receive is posted: the buffers must outlive it (the
    peer's message still lands there) and the communicator must refuse
    further calls, whose messages that receive could steal."""
    import gc
    import weakref

    c = commlib.init(timeout=30)
    try:
        if c.size == 1:
            pytest.skip("a shift on one rank moves nothing")
        comm.barrier()  # every rank is done with init before any gives up
        # a peer that dropped its shift first may stop this rank already at
        # its ring_shift_async: the notice says why either way
        with pytest.raises(commlib.CommlibError, match="dropped before its wait"):
            pending = c.ring_shift_async(np.full(1 << 16, float(c.rank)))
            receive = weakref.ref(pending._out)
            del pending
            gc.collect()
            assert receive() is not None
            c.barrier()
    finally:
        c.free()
