"""Where the NCCL backend's host waits for peers, and who may abort, without a
GPU: the stand-ins of test_nccl_stream_order, with NCCL calls that stay
inside (a peer that never joins init or a lane, a groupEnd still
connecting) until the test lets them out. What is checked: each such wait
ends at the deadline with CommTimeoutError naming what did not arrive, the
peers told and the communicator aborted, by the thread inside NCCL as it
comes out; an abort from another thread never runs while a launch is inside
NCCL and never waits for it; a launch after an abort raises the watchdog's
error without touching the communicator."""

import threading

import pytest
import test_nccl_stream_order
from test_nccl_stream_order import GIVE_UP_S, _backend, _Comm, _cupy, _Log, _Nccl, _Stream

import commlib
from commlib.backends.inflight import InFlight
from commlib.backends.nccl import NcclBackend

# the stand-in worlds, shared with the stream-order tests
world = test_nccl_stream_order.world
impatient = test_nccl_stream_order.impatient


def _in_thread(work):
    """Run ``work()`` on another thread; (thread, what it raised)."""
    raised = []

    def run():
        try:
            work()
        except BaseException as error:
            raised.append(error)
    thread = threading.Thread(target=run, name="launcher")
    thread.start()
    return thread, raised


def _connected(backend, *peers):
    """As if earlier launches had set up these links: launches run inline."""
    backend._connected |= {(kind, p) for p in peers for kind in ("send", "recv")}


def test_an_abort_while_a_launch_is_inside_nccl_waits_for_it_to_come_out(world):
    """The in-flight thread aborts while the main thread is inside ncclSend:
    the abort is left to the launch, which aborts as it comes out, and the
    launch then raises the in-flight thread's reason. Neither waits for the
    other."""
    inside, release = threading.Event(), threading.Event()
    backend, log = _backend(world, inside=inside, release=release)
    _connected(backend, 1)
    launcher, raised = _in_thread(lambda: backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=()))
    assert inside.wait(5)
    aborter, _ = _in_thread(lambda: backend._expire("ring_shift (call #1)", None))
    aborter.join(5)
    assert not aborter.is_alive()  # it did not wait for the launch
    assert log.aborts == 0  # not while the launch is inside NCCL
    release.set()
    launcher.join(5)
    assert log.aborts == 1
    assert [s[0] for s in log.steps if s[0] in ("send", "sent", "abort")] == \
        ["send", "sent", "abort"]
    assert len(raised) == 1 and isinstance(raised[0], commlib.CommTimeoutError)
    assert "did not finish on the GPU" in str(raised[0])
    with pytest.raises(commlib.CommlibError, match="can no longer be used"):
        backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())
    assert [s[0] for s in log.steps].count("send") == 1  # never on the aborted communicator


def test_a_launch_that_an_abort_overtakes_is_refused_before_it_touches_nccl(world):
    """The abort lands between the launch's check of the communicator and
    its first NCCL call: the launch raises the watchdog's error; the
    aborted communicator is never used."""
    backend, log = _backend(world)
    _connected(backend, 1)

    def abort_now():
        aborter, _ = _in_thread(lambda: backend._expire("ring_shift (call #1)", None))
        aborter.join(5)
    backend.stream.on_wait = abort_now  # after check_usable, before the launch
    with pytest.raises(commlib.CommTimeoutError, match="did not finish on the GPU"):
        backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())
    assert log.aborts == 1
    assert not [s for s in log.steps if s[0] in ("send", "recv")]


def test_a_group_end_still_connecting_times_out_and_aborts_as_it_comes_out(impatient):
    """NCCL connects lazily, inside the first groupEnd between two peers, and
    waits there for the peer: that launch runs on a helper thread while the
    caller waits under the deadline."""
    release = threading.Event()
    backend, log = _backend(impatient, release_group_end=release)
    backend.size = 2
    impatient._watchdog.begin("ring_shift")
    with pytest.raises(commlib.CommTimeoutError,
                       match=r"ring_shift \(call #\d+\) on rank 0 did not complete within 0.2s: "
                             r"NCCL was still connecting to rank\(s\) 1"):
        backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())
    assert "did not complete" in impatient._watchdog.failure  # the peers were told
    assert log.aborts == 0  # the helper is still inside groupEnd
    with pytest.raises(commlib.CommlibError, match="can no longer be used"):
        backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())  # at once: no lock to wait for
    release.set()
    assert backend.comm.aborted.wait(5)  # by the helper, out of groupEnd
    assert log.aborts == 1


def test_only_a_launch_over_a_new_link_runs_on_a_helper_thread(world):
    backend, log = _backend(world, finished=lambda: True)
    backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())()
    backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())()
    backend._grouped([(0, 8, 2)], [(0, 8, 1)], keep=())()
    senders = [who for what, who, _ in log.steps if what == "send"]
    assert senders == ["commlib-nccl-wait", threading.current_thread().name,
                       "commlib-nccl-wait"]
    assert ("commlib-nccl-wait", 0) in log.devices  # on the backend's device
    backend.free()
    assert (log.aborts, log.destroys) == (0, 1)


def _building(comm, inits):
    """A backend half made, and CuPy and NCCL stand-ins whose i-th
    NcclCommunicator(...) does ``inits[i]()``."""
    log = _Log()
    calls = iter(inits)
    nccl = _Nccl(log, init=lambda: next(calls)())
    cupy = _cupy(log, _Stream(log, "caller"), status=lambda: 0)
    return NcclBackend.__new__(NcclBackend), cupy, nccl, log


def _never_joined(log, release):
    """An init that waits for a peer until released, then succeeds."""
    comm = _Comm(log)

    def init():
        release.wait(GIVE_UP_S)
        return comm
    return comm, init


def test_a_peer_that_never_joins_init_times_out_and_the_communicator_is_aborted(impatient):
    release = threading.Event()
    backend, cupy, nccl, log = _building(impatient, [])
    late, init = _never_joined(log, release)
    nccl.init = init
    with pytest.raises(commlib.CommTimeoutError,
                       match="NCCL communicator init on rank 0 did not complete within 0.2s: a "
                             "peer never joined"):
        backend._build(cupy, nccl, impatient._host, 0, InFlight(), "NCCL communicator init")
    assert "a peer never joined" in impatient._watchdog.failure  # the peers were told
    assert [s[:2] for s in log.steps] == [("init", "commlib-nccl-wait")]
    assert log.devices[-1] == ("commlib-nccl-wait", 0)  # NCCL binds the caller's device
    release.set()
    assert late.aborted.wait(5)  # made at last, and aborted at once
    assert (log.aborts, log.destroys) == (1, 0)


def test_a_peer_that_never_makes_a_lane_times_out_and_every_lane_is_aborted(impatient):
    """A lane is made in the middle of a ring backward, by every rank together."""
    release = threading.Event()
    backend, cupy, nccl, log = _building(impatient, [])
    first = _Comm(log)
    late, init = _never_joined(log, release)
    inits = iter([lambda: first, init])
    nccl.init = lambda: next(inits)()
    backend._build(cupy, nccl, impatient._host, 0, InFlight(), "NCCL communicator init")
    assert backend.comm is first
    with pytest.raises(commlib.CommTimeoutError,
                       match="NCCL communicator init for lane 1 on rank 0 did not complete "
                             "within 0.2s: a peer never joined"):
        backend.lane(1)
    assert 1 not in backend._lanes
    assert first.aborted.is_set()  # the communicator failed: its first lane too
    release.set()
    assert late.aborted.wait(5)
    assert log.aborts == 2
