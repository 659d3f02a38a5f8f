"""Faults on CUDA arrays end within seconds, on every rank, as they do on
the host (tests/mpi/test_reliability.py, tests/test_faults.py): a rank that
never arrives makes its peers time out, naming it; a rank that rejects its
input, or refuses to allocate, makes every rank raise.

Ranks sharing one GPU run the staged MPI path (``backend="auto"`` falls back
to it); with a GPU per rank NCCL runs, whose transfers the host does not
wait for: a timed-out transfer is aborted and the next call raises.
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import memory

import arrayimpl
from conftest import all_ranks, raises_everywhere

# faults between peers, and across two hosts
WORLD_SIZES = (2, 4)

GPU_CASES = arrayimpl.params(arrayimpl.GPU)
# every fault must end well inside this, whatever the backend
SECONDS = 15


def _communicator(timeout):
    """A communicator of its own (a fault leaves it unusable), of two ranks
    or more."""
    c = commlib.init(timeout=timeout)
    if c.size == 1:
        c.free()
        pytest.skip("needs a peer")
    return c


@pytest.fixture
def impatient():
    """Gives up after 2 s: for the timeout."""
    c = _communicator(2)
    yield c
    c.free()


@pytest.fixture
def world():
    """Gives up after 60 s: a fault that ends within seconds was not a timeout."""
    c = _communicator(60)
    yield c
    c.free()


@pytest.mark.parametrize("impl", GPU_CASES)
def test_a_rank_that_never_arrives_times_out_its_peers(impatient, impl):
    """After one allreduce on every rank, rank 1 skips the next; the others
    raise within seconds (timeout=2): CommTimeoutError on at least one, naming rank 1 on
    the staged path, and PeerFailedError at most on the rest."""
    x = impl.asarray(np.ones((4, 8)), "float32")
    # every rank connects first: the stall below must meet the in-flight
    # deadline of a live NCCL communicator, not the deadline of its first connect
    impl.to_numpy(impatient.allreduce(x))
    start = time.monotonic()
    error = None
    if impatient.rank != 1:
        try:
            impl.to_numpy(impatient.allreduce(x))  # NCCL: aborted past the deadline...
            impatient.allreduce(x)  # ...and the next call raises
        except commlib.CommlibError as caught:
            error = caught
    elapsed = time.monotonic() - start
    waiting = [r for r in range(impatient.size) if r != 1]
    reports = MPI.COMM_WORLD.allgather((type(error).__name__, str(error), elapsed))
    kinds = [reports[r][0] for r in waiting]
    timeouts = [reports[r][1] for r in waiting if reports[r][0] == "CommTimeoutError"]
    assert all(kind in ("CommTimeoutError", "PeerFailedError") for kind in kinds), reports
    assert timeouts and max(report[2] for report in reports) < SECONDS, reports
    if impatient.backend == "mpi":
        assert all("rank(s) 1" in message for message in timeouts), timeouts
    if impatient.size == 2:
        assert kinds == ["CommTimeoutError"], reports


@pytest.mark.parametrize("impl", GPU_CASES)
def test_a_rank_whose_rows_do_not_match_fails_every_rank(world, impl):
    """Rank 1's alltoallv rows are [3] where the others' are [2]: every rank
    raises CollectiveMismatchError at once, and the communicator still works."""
    width = 3 if world.rank == 1 else 2
    x = impl.asarray(np.ones((world.size, width)), "float32")
    start = time.monotonic()
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: world.alltoallv(x, [1] * world.size))
    assert all_ranks("rank 1: alltoallv, dtype float32, row shape (3,)" in str(error)
                     and time.monotonic() - start < SECONDS), str(error)
    y = world.allreduce(impl.asarray(np.ones(4), "float32"))
    assert all_ranks(impl.is_native(y) and impl.to_numpy(y).tolist() == [world.size] * 4)


@pytest.mark.parametrize("impl", GPU_CASES)
def test_a_rank_that_gives_up_fails_every_rank(world, impl, monkeypatch):
    """Rank 1 refuses to allocate its alltoallv receive (after the counts
    are exchanged, when the peers may be transferring already): it raises
    AllocationRefusedError, the others PeerFailedError naming it, within
    seconds, not at their deadline."""
    if world.rank == 1:
        monkeypatch.setattr(memory, "CHECK_FROM_BYTES", 0)
        monkeypatch.setattr(memory, "available_bytes", lambda *args, **kwargs: 100)
    x = impl.asarray(np.ones((world.size * 4, 64)), "float32")
    start = time.monotonic()
    try:
        world.alltoallv(x, [4] * world.size)
        world.barrier()  # NCCL: the peers hear of it at their next call
        error = None
    except commlib.CommlibError as caught:
        error = caught
    elapsed = time.monotonic() - start
    expected = commlib.AllocationRefusedError if world.rank == 1 else commlib.PeerFailedError
    named = world.rank == 1 or "rank 1 gave up on alltoallv" in str(error)
    assert all_ranks(isinstance(error, expected) and named and elapsed < SECONDS), \
        (repr(error), elapsed)
