"""The NCCL backend without a GPU: NCCL, CuPy's streams and events stood in
for. What is checked is the contract of a stream-ordered transport: work is
enqueued after the caller's stream and the caller's stream waits for it
(the host never does); buffers live until the transfer is done; a transfer
past its deadline is aborted by the in-flight thread, once, and the next
call raises and tells the peers; a CUDA error an event reports does so at
once, naming it; any failure of the communicator aborts NCCL; a failed
launch closes its group; an aborted communicator is not destroyed again;
nothing is watched while the caller's stream is captured into a CUDA graph.
The stand-ins are shared with test_nccl_deadlines."""

import gc
import threading
import time
import weakref

import pytest

import commlib
from commlib.backends.inflight import CudaEvents, InFlight
from commlib.backends.nccl import NcclBackend

# how long a stand-in stays inside NCCL at most when a test never releases it
# (the old code, which waits there, then fails instead of hanging)
GIVE_UP_S = 3.0


NOT_READY, ILLEGAL_ADDRESS = 600, 700  # cudaError_t


class _Log:
    """What the stand-ins saw, in order."""

    def __init__(self):
        self.steps = []
        self.aborts = self.destroys = self.group_ends = self.queries = 0
        self.devices = []  # (thread name, device) of each setDevice


class _CudaError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError: CUDA's name and text for a status."""

    def __init__(self, status):
        names = {ILLEGAL_ADDRESS: "cudaErrorIllegalAddress: an illegal memory access was "
                                  "encountered"}
        super().__init__(names.get(status, f"cudaError {status}"))


class _Runtime:
    """cupy.cuda.runtime: eventQuery returns the event's cudaError_t as is."""

    streamCaptureModeThreadLocal = 1
    CUDARuntimeError = _CudaError

    def __init__(self, log):
        self.log = log

    def eventQuery(self, event):
        self.log.queries += 1
        return event.status()

    def setDevice(self, index):
        self.log.devices.append((threading.current_thread().name, index))


def _exchange_capture_mode(log):
    """cudaThreadExchangeStreamCaptureMode, which CuPy lacks (commlib calls it
    through ctypes): recorded."""
    def exchange(mode):
        log.steps.append(("capture mode", threading.current_thread().name, mode))
        return 0
    return exchange


class _Event:
    def __init__(self, log, status):
        self.log, self.status, self.stream = log, status, None

    @property
    def ptr(self):  # what the runtime stand-in is handed back
        return self

    def record(self, stream):
        self.stream = stream
        self.log.steps.append(("record", stream.name, self))

    @property
    def done(self):  # CuPy's own reading: anything but success is "not yet"
        self.log.queries += 1
        return self.status() == 0


class _Stream:
    """A stream that has no ``synchronize``: the host must not wait on it.
    ``capturing``: being captured into a CUDA graph."""

    ptr = 0

    def __init__(self, log, name, capturing=False):
        self.log, self.name, self.capturing = log, name, capturing
        self.on_wait = lambda: None

    def wait_event(self, event):
        self.log.steps.append(("wait", self.name, event))
        self.on_wait()

    def is_capturing(self):
        return self.capturing


class _Comm:
    """An NCCL communicator. ``inside``/``release``: a send that signals it
    has started and stays inside NCCL until released."""

    def __init__(self, log, fail_send=False, inside=None, release=None):
        self.log, self.fail_send = log, fail_send
        self.inside, self.release = inside, release
        self.aborted = threading.Event()

    def send(self, *args):
        if self.fail_send:
            raise RuntimeError("NCCL error: invalid usage")
        self.log.steps.append(("send", threading.current_thread().name, None))
        if self.inside is not None:
            self.inside.set()
            self.release.wait(GIVE_UP_S)
            self.log.steps.append(("sent", threading.current_thread().name, None))

    def recv(self, *args):
        self.log.steps.append(("recv", "nccl", None))

    def abort(self):
        self.log.aborts += 1
        self.log.steps.append(("abort", threading.current_thread().name, None))
        self.aborted.set()

    def destroy(self):
        self.log.destroys += 1


class _Nccl:
    """CuPy's NCCL module. ``release``: the first groupEnd stays in progress
    (NCCL connecting to a peer that never comes) until it is set. ``init``:
    what NcclCommunicator(size, uid, rank) does."""

    def __init__(self, log, release=None, init=None):
        self.log, self.release, self.init = log, release, init

    def get_unique_id(self):
        return b"u" * 128

    def NcclCommunicator(self, size, uid, rank):
        self.log.steps.append(("init", threading.current_thread().name, None))
        return self.init()

    def groupStart(self):
        pass

    def groupEnd(self):
        self.log.group_ends += 1
        if self.release is not None and self.log.group_ends == 1:
            self.release.wait(GIVE_UP_S)


def _cupy(log, caller, status):
    """CuPy's current stream and events; ``status()`` is the events'
    cudaError_t (0: fired)."""
    class cuda:
        runtime = _Runtime(log)

        @staticmethod
        def get_current_stream():
            return caller

        @staticmethod
        def Event(disable_timing):
            return _Event(log, status)

        @staticmethod
        def Stream(non_blocking):
            return _Stream(log, "nccl")

        @staticmethod
        def Device(index):
            class Device:
                @staticmethod
                def use():
                    cuda.runtime.setDevice(index)
            return Device

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


def _backend(comm, finished=lambda: False, fail_send=False, status=None, capturing=False,
             inside=None, release=None, release_group_end=None):
    """A backend on stand-ins; its events' status is ``status()``, else
    fired once ``finished()``. ``inside``, ``release``: of its sends (see
    _Comm); ``release_group_end``: of its first groupEnd (see _Nccl)."""
    log = _Log()
    caller = _Stream(log, "caller", capturing)
    status = status or (lambda: 0 if finished() else NOT_READY)
    backend = NcclBackend.__new__(NcclBackend)  # no GPU: the parts __init__ would build
    backend._nccl = _Nccl(log, release=release_group_end)
    backend._cupy = _cupy(log, caller, status)
    backend.stream = _Stream(log, "nccl")
    backend.rank, backend.size, backend.device_index = 0, 1, 0
    backend._attach(comm._watchdog, InFlight(sweep_s=0.01), root=backend,
                    comm=_Comm(log, fail_send, inside, release))
    backend._cuda = CudaEvents(backend._cupy.cuda.runtime, _exchange_capture_mode(log))
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


def test_nothing_is_watched_while_the_callers_stream_is_captured_into_a_cuda_graph(world):
    """A captured event cannot be queried (CUDA error 907, and the capture is
    lost): the transfer is ordered as usual, but not handed to the in-flight
    thread, and no event is read."""
    backend, log = _backend(world, capturing=True)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())()
    assert [s[0] for s in log.steps] == ["record", "wait", "send", "recv", "record", "wait"]
    assert backend._in_flight._transfers == [] and backend._in_flight._thread is None
    assert log.queries == 0


@pytest.fixture
def patient():
    """A world whose deadline is far from the few milliseconds a CUDA error takes."""
    comm = commlib.init(timeout=3)
    yield comm
    comm.free()


def test_a_cuda_error_on_the_gpu_aborts_at_once_and_says_which(patient):
    """cudaEventQuery's error (CuPy's Event.done reads it as "not yet") ends the
    transfer now, naming the error, instead of at the deadline as a timeout;
    free() does not wait for it."""
    backend, log = _backend(patient, status=lambda: ILLEGAL_ADDRESS)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())
    started = time.monotonic()
    backend.free()
    assert time.monotonic() - started < patient.timeout / 2
    assert (log.aborts, log.destroys) == (1, 0)
    with pytest.raises(commlib.CommlibError,
                       match="failed on the GPU with cudaErrorIllegalAddress: an illegal memory "
                             "access was encountered, so its NCCL communicator was aborted") \
            as raised:
        patient.barrier()
    # not a timeout: a longer COMMLIB_TIMEOUT would not help, restarting does
    assert not isinstance(raised.value, commlib.CommTimeoutError), raised.value
    assert "restart it" in str(raised.value) and "COMMLIB_TIMEOUT" not in str(raised.value)
    assert "cudaErrorIllegalAddress" in patient._watchdog.failure  # the peers were told
