"""Consistency checks, registered parameters, refused allocations and peers
that give up: errors on every rank, never a hang."""

import numpy as np
import pytest

import commlib
from commlib import memory

from conftest import all_ranks, raises_everywhere

# faults alone, between peers, odd, and across two hosts
WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture
def checked():
    c = commlib.init(check=True, timeout=60)
    yield c
    c.free()


@pytest.mark.parametrize("op", ["allreduce", "allgather", "ring_shift", "alltoall", "bcast"])
def test_check_catches_shape_disagreement(checked, op):
    if checked.size == 1:
        pytest.skip("needs two ranks to disagree")
    rows = checked.size * (2 if checked.rank == checked.size - 1 else 1)
    x = np.ones((rows, 3))
    call = {
        "allreduce": lambda: checked.allreduce(x),
        "allgather": lambda: checked.allgather(x),
        "ring_shift": lambda: checked.ring_shift(x),
        "alltoall": lambda: checked.alltoall(x),
        "bcast": lambda: checked.bcast(x, root=int(checked.rank == checked.size - 1)),
    }[op]
    error = raises_everywhere(commlib.CollectiveMismatchError, call, match=op)
    assert f"rank {checked.size - 1}: {op}" in str(error)
    checked.barrier()  # the communicator is still usable after a mismatch


def test_check_passes_when_ranks_agree(checked):
    y = checked.allreduce(np.full(3, checked.rank))
    assert all_ranks(y.tolist() == [sum(range(checked.size))] * 3)


def test_check_verifies_given_recv_counts(checked):
    if checked.size == 1:
        pytest.skip("needs a peer to contradict")
    x = np.ones((checked.size, 2))
    recv = [1] * checked.size
    if checked.rank == 0:
        recv = [2] + [1] * (checked.size - 2) + [0]
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: checked.alltoallv(x, [1] * checked.size, recv_counts=recv),
                      match="rank 0: recv_counts")


def test_registered_parameters_are_part_of_alltoallv(comm):
    """alltoallv checks registered parameters always, without COMMLIB_CHECK."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones((comm.size, 2))
    with comm.fingerprint(op="ring_attention", heads=8 if comm.rank else 16):
        error = raises_everywhere(commlib.CollectiveMismatchError,
                                  lambda: comm.alltoallv(x, [1] * comm.size), match="heads=16")
    assert "heads=8" in str(error)
    with comm.fingerprint(op="ring_attention", heads=8):
        y, _ = comm.alltoallv(x, [1] * comm.size)
    assert y.shape == x.shape


def test_refused_allocation_reaches_every_rank(monkeypatch):
    c = commlib.init(timeout=60)
    try:
        if c.rank == 0:
            monkeypatch.setattr(memory, "CHECK_FROM_BYTES", 0)
            monkeypatch.setattr(memory, "available_bytes", lambda on_device, framework: 100)
        x = np.ones((c.size * 4, 64), np.float32)  # 1 KiB to each rank
        try:
            c.alltoallv(x, [4] * c.size)
            first = None
        except commlib.CommlibError as error:
            first = error
        if c.rank == 0:
            assert isinstance(first, commlib.AllocationRefusedError)
            assert f"{1024 * c.size:,} bytes" in str(first) and "only 100 bytes" in str(first)
            assert isinstance(first, MemoryError)
        # a peer whose part already finished hears of it at its next call
        with pytest.raises(commlib.CommlibError, match="rank 0 gave up on alltoallv"):
            if first is not None and c.rank != 0:
                raise first
            c.barrier()
    finally:
        c.free()


def test_timeout_from_init_is_validated(comm):
    raises_everywhere(ValueError, lambda: commlib.init(timeout=-1), match="non-negative")


def test_arrays_refused_on_one_rank_stop_the_peers_at_once(comm):
    """Host and CUDA arrays mixed (or a CUDA array on the wrong GPU) are
    found on the rank that has them, before any exchange; its peers, already
    waiting in the call, hear of it instead of waiting out their deadline."""
    import time

    from commlib.dlpack import Native, unwrap

    c = commlib.init(timeout=60)
    try:
        if c.size == 1:
            pytest.skip("needs peers to tell")
        comm.barrier()  # every rank is out of init before rank 0 gives up
        started = time.monotonic()
        if c.rank == 0:
            on_gpu = Native(object(), np.dtype(np.float32), True, "cupy", lambda y: y)
            with pytest.raises(ValueError, match="host and CUDA arrays were mixed"):
                c._backend_for(unwrap(np.ones(2, np.float32)), on_gpu)
        else:
            with pytest.raises(commlib.PeerFailedError, match="host and CUDA arrays were mixed"):
                c.allreduce(np.ones(2, np.float32))
        assert time.monotonic() - started < 30
    finally:
        c.free()


def test_notices_in_flight_never_reach_a_later_communicator(comm):
    """A rank gives up and frees at once; so do its peers, before its notice
    arrives. The freed communicator's context is reused by the next one,
    which must not receive that notice: free() drains what was sent."""
    if comm.size == 1:
        pytest.skip("needs peers to tell")
    for round in range(30):
        c = commlib.init(timeout=60)
        comm.barrier()  # every rank is out of init before one gives up
        if c.rank == round % c.size:
            c._watchdog.give_up(f"round {round}")
        c.free()
    last = commlib.init(timeout=60)
    try:
        assert all_ranks(last.allreduce(np.ones(1))[0] == comm.size)
    finally:
        last.free()



def _raw(c):
    """The MPI communicators under ``c``: payload and control."""
    return c._host.comm, c._host.watchdog.control


def test_free_keeps_a_failed_communicator_and_frees_a_healthy_one(comm):
    """A call given up on may still send late (a peer's abandoned
    nonblocking collective progresses whenever that peer calls MPI), so a
    failed communicator is retired: kept unfreed, on every rank, the one
    that gave up and those that heard. A healthy one is freed."""
    from mpi4py import MPI

    if comm.size == 1:
        pytest.skip("needs peers to tell")
    healthy = commlib.init(timeout=60)
    healthy.allreduce(np.ones(1))
    raw = _raw(healthy)
    healthy.free()
    assert all_ranks(all(r == MPI.COMM_NULL for r in raw)), "a healthy communicator was kept"

    failed = commlib.init(timeout=60)
    comm.barrier()  # every rank is out of init before rank 0 gives up
    if failed.rank == 0:
        failed._watchdog.give_up("planted")
    raw = _raw(failed)
    failed.free()
    assert all_ranks(all(r != MPI.COMM_NULL and r.Get_size() == comm.size for r in raw)), \
        "a failed communicator was freed while its traffic could still arrive"


def test_free_keeps_a_communicator_whose_drain_gave_up(comm):
    """free() waits min(timeout, 5 s) for the peers' notice counts; a rank
    that stops waiting cannot know what is still coming, so it keeps the
    communicator."""
    import time

    from mpi4py import MPI

    if comm.size == 1:
        pytest.skip("needs a peer to wait for")
    c = commlib.init(timeout=0.2)
    raw = _raw(c)
    if c.rank == 0:
        time.sleep(1.0)  # the others' drain gives up on rank 0
    c.free()
    kept = all(r != MPI.COMM_NULL for r in raw)
    assert all_ranks(kept or c.rank == 0), "freed although the drain never heard rank 0"


def test_late_rounds_of_an_abandoned_collective_never_reach_a_later_communicator(comm):
    """Open MPI aborted the job ("PML OB1 received a message from a rank
    outside the valid range of the communicator") in the Comm_dup of a
    one-rank split. Cause: rank 0 gives up; rank 1 had entered a barrier
    before the notice came, late; rank 2's abandoned barrier, woken by rank
    1's message inside MPI, sends its next round to rank 0 after rank 0 has
    freed the communicator, and the one-rank communicator that takes the
    freed context finds a message from rank 2. Under Open MPI at 4 ranks on
    2 cores, 4 launches of 6 aborted before the fix, 0 of 8 after: the
    context is never freed. Needs the dissemination barrier's second round
    (4 ranks or more)."""
    import time

    from mpi4py import MPI

    if comm.size < 4:
        pytest.skip("the late round needs 4 ranks")
    for round in range(6):
        c = commlib.init(timeout=60)
        comm.barrier()
        try:
            if c.rank == 0:
                time.sleep(0.3)
                c._watchdog.give_up(f"planted in round {round}")
            elif c.rank == 1:  # in the barrier before the notice, but slow
                time.sleep(1.0)
                c._watchdog.hold(c._host.comm.Ibarrier())
            else:
                c.barrier()
        except commlib.PeerFailedError:
            pass
        c.free()
        if c.rank == 0:
            time.sleep(0.5)  # the late round arrives
        # one-rank communicators take the lowest free contexts (split, then Comm_dup)
        alone = [comm.split(comm.rank) for _ in range(3)]
        stray = any(raw.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG) for a in alone for raw in _raw(a))
        for a in alone:
            a.free()
        assert all_ranks(not stray), f"round {round}: a one-rank communicator got a message"


LATE_TIMEOUT = 2.0


def _raised_with_the_last_rank_late(call):
    """``call()`` on every rank, the last one joining only once the others'
    deadline (LATE_TIMEOUT) has passed: (result, None) or (None, the
    CommlibError raised). Without a deadline the others would just wait for
    it, and every rank would return a result."""
    import time

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world.Barrier()
    if world.rank == world.size - 1:
        time.sleep(LATE_TIMEOUT + 1.0)
    try:
        return call(), None
    except commlib.CommlibError as error:
        return None, error


def _timed_out(error) -> bool:
    """This rank timed out, or heard that a peer did."""
    return isinstance(error, commlib.CommTimeoutError) or \
        (isinstance(error, commlib.PeerFailedError) and "timed out" in str(error))


def test_a_rank_late_for_split_makes_the_others_time_out(comm):
    """MPI's Comm_split has no deadline: the ranks agree under the watchdog
    first. The ranks on time raise at their deadline (or on a peer's notice
    that it timed out); the late one hears of it."""
    if comm.size == 1:
        pytest.skip("needs a rank to be late")
    parent = commlib.init(timeout=LATE_TIMEOUT)
    child, error = _raised_with_the_last_rank_late(lambda: parent.split(0))
    late = parent.rank == parent.size - 1
    try:
        assert all_ranks(error is not None), "split waited for the late rank"
        assert all_ranks("split" in str(error)), str(error)
        assert all_ranks(late or _timed_out(error)), str(error)
        assert all_ranks(not late or isinstance(error, commlib.PeerFailedError)), str(error)
    finally:
        if child is not None:
            child.free()
        parent.free()


def test_a_rank_late_for_init_makes_the_others_time_out(comm):
    """init's duplicate of the caller's communicator has a deadline too:
    the ranks on time raise CommTimeoutError; so does the late one, at its
    own deadline, on the duplicate's barrier that the others never join."""
    if comm.size == 1:
        pytest.skip("needs a rank to be late")
    made, error = _raised_with_the_last_rank_late(lambda: commlib.init(timeout=LATE_TIMEOUT))
    try:
        assert all_ranks(isinstance(error, commlib.CommTimeoutError)), \
            f"init did not time out: {error!r}"
        assert all_ranks("init" in str(error) and "timed out after 2s" in str(error)), str(error)
    finally:
        if made is not None:
            made.free()


@pytest.mark.parametrize("color, key, wrong", [("0", 0, "color must be a non-negative integer"),
                                               (True, 0, "color must be a non-negative integer"),
                                               (0, 2**31, "key must be an integer in")])
def test_split_arguments_are_checked_on_every_rank(color, key, wrong):
    """One rank's bad color or key raises CollectiveMismatchError on every
    rank, naming that rank; the communicator stays usable."""
    c = commlib.init(timeout=60)
    bad = c.size - 1
    try:
        try:
            c.split(*((color, key) if c.rank == bad else (0, 0)))
            caught = None
        except commlib.CollectiveMismatchError as error:
            caught = error
        except Exception:  # refused on this rank alone: its peers wait in MPI's split;
            caught = None   # join them, so that the test fails instead of hanging
            c.split(0)
        assert all_ranks(caught is not None), "not refused on every rank"
        assert all_ranks(f"split was rejected by rank(s) {bad}" in str(caught)
                         and wrong in str(caught)), str(caught)
        assert all_ranks(c.split(0).size == c.size)
    finally:
        c.free()


def test_free_frees_the_children_and_refuses_their_later_use():
    """Sub-communicators belong to their parent: its free() frees them (and
    theirs), and a call on one then says it was freed."""
    from mpi4py import MPI

    parent = commlib.init(timeout=60)
    child = parent.split(parent.rank % 2)
    grandchild = child.split(0)
    raw = _raw(child) + _raw(grandchild)
    parent.free()
    assert all_ranks(all(r == MPI.COMM_NULL for r in raw)), "a child was not freed"
    for orphan in (child, grandchild):
        with pytest.raises(commlib.CommlibError, match=r"was freed \(with its parent\)"):
            orphan.allreduce(np.ones(1))
    with pytest.raises(commlib.CommlibError, match=r"was freed \(by free\(\)\)"):
        parent.split(0)


def test_a_child_freed_first_is_freed_once(monkeypatch):
    parent = commlib.init(timeout=60)
    child = parent.split(0)
    frees = []
    free = child._host.free
    monkeypatch.setattr(child._host, "free", lambda: frees.append(1) or free())
    child.free()
    child.free()  # a second free does nothing
    parent.free()  # nor does the parent's
    assert all_ranks(frees == [1]), f"freed {len(frees)} times"


def test_a_cached_split_is_made_once_and_again_after_free():
    from mpi4py import MPI

    parent = commlib.init(timeout=60)
    color = parent.rank % 2
    members = sum(1 for r in range(parent.size) if r % 2 == color)
    try:
        first = parent.split(color, key=parent.rank, cache_key=("test", 2))
        assert parent.split(color, key=parent.rank, cache_key=("test", 2)) is first
        with pytest.raises(ValueError, match="give each split its own cache_key"):
            parent.split(1 - color, key=parent.rank, cache_key=("test", 2))
        other = parent.split(0, cache_key="other")
        assert other is not first and other.size == parent.size
        first.free()
        again = parent.split(color, key=parent.rank, cache_key=("test", 2))
        assert again is not first
        assert all_ranks(again.allreduce(np.ones(1))[0] == members)
        raw = _raw(again) + _raw(other)
    finally:
        parent.free()
    assert all_ranks(all(r == MPI.COMM_NULL for r in raw)), "a cached child outlived its parent"
