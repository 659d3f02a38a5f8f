"""The in-flight thread without a GPU: the CUDA runtime stood in for, with
each thread's current device and the contexts the runtime would create.
What is checked: the thread makes the transfer's device current, then
enters thread-local capture mode, before its first event query (no context
on GPU 0, no query forbidden by another thread's graph capture), and leaves
the main thread's device alone; an event that reports a CUDA error ends its
transfer at once, naming the error."""

import threading

import pytest

from commlib.backends import inflight
from commlib.backends.inflight import CudaEvents, InFlight

SUCCESS, NOT_READY, ILLEGAL_ADDRESS = 0, 600, 700  # cudaError_t
THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal


class _Runtime:
    """cupy.cuda.runtime, per thread as CUDA is: a thread's current device is
    0 until it sets one, and a call that needs a context creates the
    current device's primary context."""

    streamCaptureModeThreadLocal = THREAD_LOCAL

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            super().__init__({ILLEGAL_ADDRESS: "cudaErrorIllegalAddress: an illegal memory "
                                               "access was encountered"}[status])

    def __init__(self):
        self.calls = []  # (thread, what, argument)
        self.contexts = set()
        self.watcher_queried = threading.Event()
        self._current = threading.local()

    def device(self):
        return getattr(self._current, "device", 0)

    def _call(self, what, argument=None):
        self.calls.append((threading.current_thread(), what, argument))
        self.contexts.add(self.device())

    def setDevice(self, index):
        self._current.device = index
        self._call("setDevice", index)

    def exchange_capture_mode(self, mode):
        self._call("capture mode", mode)
        return SUCCESS

    def eventQuery(self, event):
        self._call("query")
        if threading.current_thread() is not threading.main_thread():
            self.watcher_queried.set()
        return event.status


class _Event:
    def __init__(self, status):
        self.status = status

    @property
    def ptr(self):
        return self


def _add(watched, runtime, status, device, expired, timeout=60.0):
    watched.add("owner", _Event(status), keep=(), timeout=timeout, what="ring_shift (call #1)",
                expire=lambda what, error: expired.append((what, error)), device=device,
                cuda=CudaEvents(runtime, runtime.exchange_capture_mode))


def test_the_thread_sets_the_transfers_device_then_thread_local_mode_before_its_first_query():
    runtime, expired = _Runtime(), []
    runtime.setDevice(1)  # the main thread's device: the user's choice, whatever it is
    watched = InFlight(sweep_s=0.001)
    _add(watched, runtime, NOT_READY, device=3, expired=expired)
    assert runtime.watcher_queried.wait(5)
    watched.forget("owner")
    watcher = [(what, arg) for thread, what, arg in runtime.calls
               if thread is not threading.main_thread()]
    assert watcher[:3] == [("setDevice", 3), ("capture mode", THREAD_LOCAL), ("query", None)]
    assert watcher.count(("setDevice", 3)) == 1 and watcher.count(("capture mode", 1)) == 1
    main = [what for thread, what, _ in runtime.calls if thread is threading.main_thread()]
    assert set(main) <= {"setDevice", "query"} and main.count("setDevice") == 1  # the test's own
    assert runtime.device() == 1  # the main thread's device is untouched
    assert runtime.contexts == {1, 3}  # never one on GPU 0
    assert expired == []


def test_an_event_that_reports_a_cuda_error_expires_its_transfer_at_once_naming_it():
    runtime, expired = _Runtime(), []
    watched = InFlight(sweep_s=3600)  # only this thread sweeps
    _add(watched, runtime, ILLEGAL_ADDRESS, device=0, expired=expired, timeout=600.0)
    watched.sweep()
    assert expired == [("ring_shift (call #1)",
                        "cudaErrorIllegalAddress: an illegal memory access was encountered")]
    assert watched.pending("owner") == 1  # still held: NCCL may touch it until the abort
    watched.forget("owner")
    assert watched.pending("owner") == 0 and len(expired) == 1


def test_a_transfer_past_its_deadline_expires_once_with_no_error():
    runtime, expired = _Runtime(), []
    watched = InFlight(sweep_s=3600)
    _add(watched, runtime, NOT_READY, device=0, expired=expired, timeout=0.0)
    watched.sweep()
    watched.sweep()
    assert expired == [("ring_shift (call #1)", None)]


def test_the_capture_mode_is_exchanged_through_the_cuda_runtime_cupy_loaded():
    """CuPy 14 wraps no cudaThreadExchangeStreamCaptureMode: it is called through
    ctypes on the libcudart that cuda.pathfinder found for CuPy."""
    pytest.importorskip("cupy")
    pathfinder = pytest.importorskip("cuda.pathfinder")
    try:
        path = pathfinder.load_nvidia_dynamic_lib("cudart").abs_path
    except Exception as error:  # no CUDA runtime library on this machine
        pytest.skip(f"no CUDA runtime library: {error}")
    assert inflight._cudart()._name == path
    statuses = []  # on a thread of its own: the mode is the calling thread's
    thread = threading.Thread(target=lambda: statuses.append(
        inflight.exchange_capture_mode(THREAD_LOCAL)))
    thread.start()
    thread.join()
    assert len(statuses) == 1 and isinstance(statuses[0], int)  # cudaSuccess with a driver
