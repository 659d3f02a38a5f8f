"""GPU transfers the host does not wait for, and the thread that watches them.

A stream-ordered transport (NCCL) enqueues its work on a CUDA stream and
returns; the caller's stream waits on an event recorded after it, so the
host never blocks. Two things still need someone to look: the buffers of a
transfer must stay alive until its event fires, and a transfer that never
finishes (a peer died, a rank went elsewhere) or that failed on the GPU must
be aborted instead of leaving kernels spinning forever. ``InFlight`` keeps
each transfer's event, buffers and deadline; one daemon thread per process
sweeps them, as PyTorch's ProcessGroupNCCL watchdog does. The thread only
reads events and calls the owner's ``expire``; raising, and telling the
peers, is left to the owner's next call on the main thread.

Reading an event from that thread has three traps, each met by PyTorch first:

- a new thread's CUDA device is 0, and its first runtime call creates a
  primary context there (~0.5 GiB on every rank that drives another GPU):
  the thread makes each transfer's device current before it reads the event;
- an event query is prohibited while another thread captures a CUDA graph in
  the (default) global mode, and invalidates that capture: the thread puts
  itself in thread-local capture mode (``cudaThreadExchangeStreamCaptureMode``)
  before its first query, so that only its own captures (it has none) bind it;
- CuPy's ``Event.done`` reads any error as "not yet": a sticky CUDA error
  would look like a slow transfer until the deadline. The status is read
  here: ready, not ready, or the error, which expires the transfer at once.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

# how often the thread looks: deadlines are seconds to minutes, and the
# main thread releases finished transfers itself whenever it adds one
SWEEP_S = 0.05
# cudaError_t (driver_types.h)
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600


@functools.lru_cache(maxsize=None)
def _cudart():
    """The CUDA runtime library CuPy loaded. CuPy 14 finds it with
    ``cuda.pathfinder``, whose answer is cached for the process, and a second
    ``dlopen`` of that path returns the same library."""
    import ctypes

    from cuda import pathfinder

    return ctypes.CDLL(pathfinder.load_nvidia_dynamic_lib("cudart").abs_path)


def exchange_capture_mode(mode: int) -> int:
    """``cudaThreadExchangeStreamCaptureMode`` for the calling thread, which
    CuPy 14 does not wrap: called through ctypes. Returns its cudaError_t."""
    import ctypes

    value = ctypes.c_int(mode)
    return _cudart().cudaThreadExchangeStreamCaptureMode(ctypes.byref(value))


class CudaEvents:
    """What the watching thread asks the CUDA runtime (CuPy's
    ``cupy.cuda.runtime``), and nothing more."""

    def __init__(self, runtime: Any,
                 exchange_mode: Callable[[int], int] = exchange_capture_mode):
        self._runtime = runtime
        self._exchange_mode = exchange_mode

    def status(self, event: Any) -> int:
        """cudaEventQuery's cudaError_t, unchecked (CuPy returns it as is)."""
        return self._runtime.eventQuery(event.ptr)

    def use_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device (its own
        context; other threads keep theirs)."""
        self._runtime.setDevice(index)

    def isolate_from_captures(self) -> None:
        """Thread-local capture mode for the calling thread: another thread's
        global-mode capture no longer forbids its queries."""
        status = self._exchange_mode(self._runtime.streamCaptureModeThreadLocal)
        if status != CUDA_SUCCESS:
            raise RuntimeError(self.describe(status))

    def describe(self, status: int) -> str:
        """A cudaError_t as CUDA names it ("cudaErrorIllegalAddress: an
        illegal memory access was encountered")."""
        return str(self._runtime.CUDARuntimeError(status))


@dataclass
class Transfer:
    """One enqueued transfer, finished when ``event`` has fired on ``device``.
    ``failed``: expired (late, or a CUDA error); held until its owner, once
    aborted, forgets it."""

    owner: Any
    event: Any
    keep: tuple
    deadline: float
    what: str
    expire: Callable[[str, Optional[str]], None]
    device: int
    cuda: CudaEvents
    failed: bool = False


@dataclass
class _Watcher:
    """The watching thread's own CUDA state."""

    device: Optional[int] = None  # the current device it set; None before the first
    isolated: bool = False


class InFlight:
    """The transfers still on their way, across every stream-ordered
    transport of the process."""

    def __init__(self, sweep_s: float = SWEEP_S):
        self._sweep_s = sweep_s
        self._transfers: List[Transfer] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def add(self, owner: Any, event: Any, keep: tuple, timeout: float, what: str,
            expire: Callable[[str, Optional[str]], None], *, device: int,
            cuda: CudaEvents) -> None:
        """Watch ``event`` (recorded on a stream of ``device``): hold ``keep``
        until it fires. Call ``expire(what, None)`` once if it has not fired
        ``timeout`` seconds from now, ``expire(what, cuda_error)`` at once if
        CUDA reports an error for it. Never while the event's stream is being
        captured into a CUDA graph: a captured event cannot be queried (and a
        graph owns no memory: its owner keeps the buffers of a captured
        launch, ``NcclBackend._captured``)."""
        deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
        with self._lock:
            self._transfers.append(Transfer(owner, event, keep, deadline, what, expire,
                                            device, cuda))
        self.sweep()
        self._start()

    def pending(self, owner: Any) -> int:
        """How many of ``owner``'s transfers have not finished yet."""
        self.sweep()
        with self._lock:
            return sum(t.owner is owner for t in self._transfers)

    def forget(self, owner: Any) -> None:
        """Drop ``owner``'s transfers unwatched (its communicator was aborted:
        NCCL no longer touches their buffers)."""
        with self._lock:
            self._transfers = [t for t in self._transfers if t.owner is not owner]

    def sweep(self) -> None:
        """Release finished transfers; expire those past their deadline or
        failed. On the calling thread's current device (the main thread's is
        the transfers' own)."""
        self._sweep(None)

    def _sweep(self, watcher: Optional[_Watcher]) -> None:
        now = time.monotonic()
        ended, owners = [], set()
        with self._lock:
            waiting = []
            for transfer in self._transfers:
                if not transfer.failed:
                    error = _outcome(transfer, watcher)
                    if error is _FINISHED:
                        continue
                    if error is not None or now > transfer.deadline:
                        transfer.failed = True
                        if id(transfer.owner) not in owners:  # once per owner: it aborts
                            owners.add(id(transfer.owner))
                            ended.append((transfer, error))
                waiting.append(transfer)
            self._transfers = waiting
        for transfer, error in ended:  # outside the lock: expiring aborts, which may take a while
            transfer.expire(transfer.what, error)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="commlib-inflight",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        watcher = _Watcher()
        while True:
            time.sleep(self._sweep_s)
            self._sweep(watcher)


_FINISHED = object()


def _outcome(transfer: Transfer, watcher: Optional[_Watcher]):
    """_FINISHED, None (still running) or the CUDA error that ended it. On the
    watching thread, the transfer's device is made current first, then the
    thread isolated from other threads' captures, before its first query."""
    cuda = transfer.cuda
    try:
        if watcher is not None:
            if watcher.device != transfer.device:
                cuda.use_device(transfer.device)
                watcher.device = transfer.device
            if not watcher.isolated:
                watcher.isolated = True
                _isolate(cuda)
        return event_outcome(cuda, transfer.event)
    except Exception as error:  # a CUDA error raised by setDevice, say: the transfer failed
        return f"{type(error).__name__}: {error}"


def event_outcome(cuda: CudaEvents, event: Any):
    """_FINISHED, None (not yet) or the CUDA error that ended the work before
    ``event``, in CUDA's words: the one reading of an event's status (the
    staged MPI path reads its copies' events with it too)."""
    status = cuda.status(event)
    if status == CUDA_SUCCESS:
        return _FINISHED
    if status == CUDA_ERROR_NOT_READY:
        return None
    return cuda.describe(status)


def _isolate(cuda: CudaEvents) -> None:
    try:
        cuda.isolate_from_captures()
    except Exception as error:  # no CUDA runtime library found, say: still watch
        sys.stderr.write(f"commlib: the in-flight thread could not enter thread-local CUDA "
                         f"capture mode ({error}); a CUDA graph captured in global mode while "
                         f"transfers are in flight may be invalidated by its event queries\n")


# the process's one watcher
IN_FLIGHT = InFlight()
