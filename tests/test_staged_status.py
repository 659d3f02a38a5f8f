"""Without a GPU: how the staged path reads its copies' CUDA events, and
which MPI thread level the helper threads need.

The staged device is CupyDevice's own status reading over a stand-in CUDA
runtime (events report a cudaError_t sequence; their ``done`` is CuPy's
reading, which takes any error for "not yet"). What is checked: a copy
whose event reports a CUDA error ends the call at once with CommlibError
naming the error, and this rank gives up (its peers are told), instead of a
CommTimeoutError at the deadline; not-ready then ready is done. Below
MPI_THREAD_MULTIPLE the NCCL backend is refused by name under "nccl" and
left for MPI under "auto", and no progress thread starts."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib import progress
from commlib.backends import nccl
from commlib.backends.inflight import CudaEvents
from commlib.backends.staged import CupyDevice, HostCopies, StagedBackend

SUCCESS, NOT_READY, ILLEGAL_ADDRESS = 0, 600, 700  # cudaError_t
ILLEGAL_TEXT = "cudaErrorIllegalAddress: an illegal memory access was encountered"
# the deadline the old reading ran into; the error must come well before it
DEADLINE_S = 5.0


class _Runtime:
    """cupy.cuda.runtime: eventQuery returns the event's next status as is."""

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status):
            super().__init__({ILLEGAL_ADDRESS: ILLEGAL_TEXT}.get(status, f"cudaError {status}"))

    def eventQuery(self, event):
        return event.query()


class _Event:
    """A CUDA event whose queries report ``statuses`` in turn (the last one
    from then on)."""

    def __init__(self, statuses):
        self.statuses, self.queries = list(statuses), 0

    def query(self):
        self.queries += 1
        return self.statuses[min(self.queries, len(self.statuses)) - 1]

    @property
    def ptr(self):
        return self

    @property
    def done(self):  # CuPy's Event.done: anything but success is "not yet"
        return self.query() == SUCCESS


class _Device(HostCopies):
    """NumPy copies whose tokens are events reporting ``statuses``, read by
    CupyDevice's own ``done``."""

    done = CupyDevice.done

    def __init__(self, statuses):
        super().__init__()
        self._events = CudaEvents(_Runtime(), exchange_mode=None)
        self.statuses, self.events = statuses, []

    def _event(self):
        self.events.append(_Event(self.statuses))
        return self.events[-1]

    def download(self, src, dst):
        super().download(src, dst)
        return self._event()

    def upload(self, src, dst):
        super().upload(src, dst)
        return self._event()

    def copy(self, src, dst):
        super().copy(src, dst)
        return self._event()


@pytest.fixture
def world():
    comm = commlib.init(backend="mpi", timeout=DEADLINE_S)
    yield comm
    comm.free()


def _allreduce(backend, data):
    out = np.zeros_like(data)
    backend.allreduce(data, out, data.dtype, "sum")
    return out


def _alltoall(backend, data):
    out = np.zeros_like(data)
    backend.alltoall(data, out)
    return out


CALLS = {"allreduce (its own wait)": _allreduce, "alltoall (the chunk pipeline)": _alltoall}


@pytest.mark.parametrize("call", CALLS.values(), ids=list(CALLS))
def test_a_copy_that_fails_on_the_gpu_ends_the_call_at_once_naming_the_error(world, call):
    device = _Device([NOT_READY, ILLEGAL_ADDRESS])
    backend = StagedBackend(world._host, device=device, cuda_aware=False)
    world._host.watchdog.op = "staged test"
    start = time.monotonic()
    with pytest.raises(commlib.CommlibError) as raised:
        call(backend, np.arange(8, dtype=np.float32))
    assert time.monotonic() - start < DEADLINE_S / 2
    assert not isinstance(raised.value, commlib.CommTimeoutError)
    assert ILLEGAL_TEXT in str(raised.value)
    assert "copy between the GPU and host memory" in str(raised.value)
    assert "restart it" in str(raised.value)
    # this rank gave up: the peers were told, and the communicator refuses calls
    assert ILLEGAL_TEXT in world._host.watchdog.failure
    with pytest.raises(commlib.CommlibError, match="can no longer be used"):
        world._host.watchdog.check_usable()


@pytest.mark.parametrize("call", CALLS.values(), ids=list(CALLS))
def test_a_copy_not_ready_then_ready_is_done(world, call):
    device = _Device([NOT_READY, NOT_READY, SUCCESS])
    backend = StagedBackend(world._host, device=device, cuda_aware=False)
    data = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(call(backend, data), data)  # one rank: itself
    assert device.events and all(event.queries == 3 for event in device.events)
    assert world._host.watchdog.failure is None


@pytest.fixture
def one_gpu(monkeypatch):
    """A GPU of its own and NCCL, as far as init can tell."""
    monkeypatch.setattr(nccl, "unavailable_reason", lambda: None)
    monkeypatch.setattr(nccl, "current_device", lambda: 0)
    monkeypatch.setattr(nccl, "visible_devices", lambda: 1)
    monkeypatch.setattr(nccl, "device_identity", lambda index: f"GPU {index}")
    monkeypatch.setattr(nccl, "shares_gpus_allowed", lambda: False)
    monkeypatch.setattr(nccl, "NcclBackend", lambda host, index: SimpleNamespace(
        name="nccl", device_index=index, free=lambda: None))


def _thread_level(monkeypatch, level):
    monkeypatch.setattr(MPI, "Query_thread", lambda: level)


@pytest.mark.parametrize("level, asked, built", [
    ("THREAD_MULTIPLE", "nccl", "nccl"), ("THREAD_MULTIPLE", "auto", "nccl"),
    ("THREAD_SERIALIZED", "auto", "mpi")])
def test_nccl_is_built_only_at_thread_multiple(one_gpu, monkeypatch, level, asked, built):
    _thread_level(monkeypatch, getattr(MPI, level))
    comm = commlib.init(backend=asked)
    try:
        assert comm.backend == built
    finally:
        comm.free()


@pytest.mark.parametrize("level", ["THREAD_SERIALIZED", "THREAD_FUNNELED", "THREAD_SINGLE"])
def test_nccl_below_thread_multiple_is_refused_by_name(one_gpu, monkeypatch, level):
    _thread_level(monkeypatch, getattr(MPI, level))
    with pytest.raises(commlib.BackendUnavailableError) as raised:
        commlib.init(backend="nccl")
    message = str(raised.value)
    assert f"rank 0: MPI was initialized at thread level MPI_{level}" in message
    assert "needs MPI_THREAD_MULTIPLE" in message
    assert "mpi4py.rc.thread_level" in message


def test_no_progress_thread_below_thread_multiple_even_when_asked(monkeypatch, capfd):
    monkeypatch.setenv(progress.THREAD_ENV, "1")
    monkeypatch.setattr(progress, "_told_thread_level", False)
    _thread_level(monkeypatch, MPI.THREAD_SERIALIZED)
    driver = progress.Progress()
    before = set(threading.enumerate())
    for _ in range(2):
        driver.start()
        driver.finish()
    assert driver._thread is None
    assert not [t for t in set(threading.enumerate()) - before if t.name == "commlib-progress"]
    err = capfd.readouterr().err
    assert err.count("below MPI_THREAD_MULTIPLE, which a progress thread needs") == 1
    _thread_level(monkeypatch, MPI.THREAD_MULTIPLE)
    monkeypatch.setattr(progress.Progress, "_drive", lambda self: None)  # no MPI from it here
    driver.start()
    driver.finish()
    assert driver._thread is not None
