"""The NCCL backend without a GPU: NCCL, CuPy's streams and events stood in
for. What is checked is the contract of a stream-ordered transport: work is
enqueued after the caller's stream and the caller's stream waits for it
(the host never does); buffers live until the transfer is done; a transfer
past its deadline is aborted by the in-flight thread, once, and the next
call raises and tells the peers; any failure of the communicator aborts
NCCL; a failed launch closes its group; an aborted communicator is not
destroyed again."""

import gc
import time
import weakref

import pytest

import commlib
from commlib.backends.inflight import InFlight
from commlib.backends.nccl import NcclBackend


class _Log:
    """What the stand-ins saw, in order."""

    def __init__(self):
        self.steps = []
        self.aborts = self.destroys = self.group_ends = 0


class _Event:
    def __init__(self, log, finished):
        self.log, self.finished, self.stream = log, finished, None

    def record(self, stream):
        self.stream = stream
        self.log.steps.append(("record", stream.name, self))

    @property
    def done(self):
        return self.finished()


class _Stream:
    """A stream that has no ``synchronize``: the host must not wait on it."""

    ptr = 0

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.steps.append(("wait", self.name, event))


class _Comm:
    def __init__(self, log, fail_send):
        self.log, self.fail_send = log, fail_send

    def send(self, *args):
        if self.fail_send:
            raise RuntimeError("NCCL error: invalid usage")
        self.log.steps.append(("send", "nccl", None))

    def recv(self, *args):
        self.log.steps.append(("recv", "nccl", None))

    def abort(self):
        self.log.aborts += 1

    def destroy(self):
        self.log.destroys += 1


class _Nccl:
    def __init__(self, log):
        self.log = log

    def groupStart(self):
        pass

    def groupEnd(self):
        self.log.group_ends += 1


def _cupy(log, caller, finished):
    """CuPy's current stream and events; ``finished()`` says whether the
    events have fired."""
    class cuda:
        @staticmethod
        def get_current_stream():
            return caller

        @staticmethod
        def Event(disable_timing):
            return _Event(log, finished)

    class cupy:
        pass
    cupy.cuda = cuda
    return cupy


@pytest.fixture
def world():
    comm = commlib.init(timeout=60)
    yield comm
    comm.free()


@pytest.fixture
def impatient():
    """A world whose deadline passes while a test looks."""
    comm = commlib.init(timeout=0.2)
    yield comm
    comm.free()


def _backend(comm, finished=lambda: False, fail_send=False):
    log = _Log()
    caller = _Stream(log, "caller")
    backend = NcclBackend.__new__(NcclBackend)  # no GPU: the parts __init__ would build
    backend.comm, backend._nccl = _Comm(log, fail_send), _Nccl(log)
    backend._cupy = _cupy(log, caller, finished)
    backend.stream = _Stream(log, "nccl")
    backend.rank, backend.size, backend.device_index = 0, 1, 0
    backend._attach(comm._watchdog, InFlight(sweep_s=0.01), root=backend)
    return backend, log


def test_work_is_ordered_between_the_callers_stream_and_back_without_the_host_waiting(world):
    backend, log = _backend(world)
    finish = backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    enqueued = list(log.steps)
    finish()
    (rec1, on1, before), (wait1, who1, what1) = enqueued[0][:3], enqueued[1][:3]
    assert (rec1, on1, wait1, who1) == ("record", "caller", "wait", "nccl")
    assert what1 is before  # NCCL's stream waits for what the caller queued first
    assert [s[0] for s in enqueued[2:4]] == ["send", "recv"]
    assert enqueued[4][:2] == ("record", "nccl")
    after = enqueued[4][2]
    assert log.steps[-1] == ("wait", "caller", after)  # the caller's stream waits for NCCL


def test_buffers_live_until_their_transfer_is_done(world):
    fired = {"now": False}
    backend, _ = _backend(world, finished=lambda: fired["now"])

    class Buffer:
        pass
    buffer = Buffer()
    alive = weakref.ref(buffer)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=(buffer,))
    del buffer
    gc.collect()
    assert alive() is not None and backend._in_flight.pending(backend) == 1
    fired["now"] = True
    assert backend._in_flight.pending(backend) == 0
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("next_call", ["the transfer's own wait", "a host-only call"])
def test_a_transfer_past_its_deadline_is_aborted_and_the_next_call_raises(impatient, next_call):
    backend, log = _backend(impatient)
    finish = backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    give_up_by = time.monotonic() + 10
    while log.aborts == 0 and time.monotonic() < give_up_by:
        time.sleep(0.01)  # the in-flight thread, not this one, notices
    assert log.aborts == 1
    first, then = (impatient.barrier, finish) if next_call == "a host-only call" else \
        (finish, impatient.barrier)
    with pytest.raises(commlib.CommTimeoutError, match="did not finish on the GPU within"):
        first()
    assert "did not finish" in impatient._watchdog.failure  # the peers were told
    with pytest.raises(commlib.CommlibError, match="can no longer be used"):
        then()
    backend.free()
    assert (log.aborts, log.destroys) == (1, 0)


def test_any_failure_of_the_communicator_aborts_nccl_once(world):
    backend, log = _backend(world)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    world._watchdog.give_up("rank 0 rejected its input")
    world._watchdog.give_up("and again")
    assert log.aborts == 1
    assert backend._in_flight.pending(backend) == 0  # NCCL let go of the buffers
    backend.free()
    assert log.destroys == 0


def test_a_failed_launch_closes_the_group_tells_the_peers_and_aborts(world):
    backend, log = _backend(world, fail_send=True)
    with pytest.raises(RuntimeError, match="invalid usage"):
        backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    assert (log.aborts, log.group_ends) == (1, 1)
    assert "NCCL launch failed: NCCL error: invalid usage" in world._watchdog.failure
    with pytest.raises(commlib.CommlibError, match="can no longer be used"):
        world.barrier()


def test_free_waits_for_transfers_in_flight_then_destroys(world):
    started = time.monotonic()
    backend, log = _backend(world, finished=lambda: time.monotonic() - started > 0.05)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    backend.free()
    assert (log.aborts, log.destroys) == (0, 1)


def test_lane_must_be_a_non_negative_integer(world):
    with pytest.raises(ValueError, match="lane must be a non-negative integer"):
        world.ring_shift_async([1.0, 2.0], lane=-1)
