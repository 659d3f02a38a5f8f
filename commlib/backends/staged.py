"""CUDA buffers over MPI: what a communicator without NCCL uses for CUDA
arrays (several ranks sharing one GPU, or no NCCL library).

Two paths, chosen per process by ``backends.cuda_aware.detect()``
(``COMMLIB_MPI_CUDA_AWARE`` overrides it; ``StagedBackend.path`` says which):

- **cuda-aware**: the caller's stream is synchronized (MPI knows nothing of
  CUDA streams) and the device buffers go to MPI as they are;
- **staged**: every message goes through pinned host memory. Each block is
  cut into chunks of ``CHUNK_BYTES``; the chunks are copied to the host
  asynchronously on a side stream (ordered after the caller's current CuPy
  stream), each is sent as soon as its copy is done, and each received
  chunk is copied up on a second side stream as soon as it arrives, so
  that device-to-host copies, MPI transfers and host-to-device copies
  overlap. Pinned buffers come from a pool that only grows (one per
  process, shared by the communicators).

Both paths use only point-to-point messages, in the same chunks and with
their own tag (``mpi.CHUNK_TAG``): CUDA-aware MPIs accept device memory
there, while Open MPI's nonblocking collectives do not take it. So
``allgather`` and ``bcast`` are pairwise sends here (a linear ``bcast``
from the root), and ``allreduce`` is always reduced on the host, by logical
value (bfloat16 and float8 live on the device as integer storage).

Every wait, for the device's copies as for MPI, is polled by the host
backend's watchdog: deadlines and failure notices as for host arrays. A
copy's event is read as the NCCL path reads its events
(``inflight.event_outcome``): a CUDA error it reports (CuPy's
``Event.done`` would read it as "not yet", until the deadline) makes this
rank give up at once, telling the peers, and raise ``CommlibError`` naming
it. When a call returns, its results are complete (for any stream), as with
NCCL.
All the device work goes through a small *device* object, so that the whole
pipeline runs on NumPy arrays in the tests (``HostCopies``, or the lazy
stream stand-in of ``tests/mpi/test_staged.py``).
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..dlpack import byte_view
from ..errors import CommlibError
from . import RepeatedAlltoall, displacements
from .cuda_aware import detect as cuda_aware_detect
from .inflight import CudaEvents, event_outcome

# Chunk size of both paths: a few MiB, so that the cost of one more message
# is small next to moving its bytes, while a block of tens of MiB still makes
# several chunks in flight (not tuned on a GPU yet). Must be the same on
# every rank: the receiver posts one receive per chunk.
CHUNK_BYTES = 4 << 20
# smallest pinned buffer the pool allocates (pinned allocations are slow)
_MIN_PINNED_BYTES = 1 << 20

class PinnedPool:
    """Host staging buffers, kept and reused: it only grows. ``take`` hands
    out a buffer of at least ``nbytes`` (the smallest free one that fits,
    else a new one rounded up to a power of two), ``give`` returns it."""

    def __init__(self, allocate: Callable[[int], np.ndarray]):
        self._allocate = allocate
        self._free: List[np.ndarray] = []
        self.held_bytes = 0

    def take(self, nbytes: int) -> np.ndarray:
        fits = [i for i, buf in enumerate(self._free) if buf.nbytes >= nbytes]
        if fits:
            return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
        size = max(_MIN_PINNED_BYTES, 1 << max(nbytes - 1, 0).bit_length())
        self.held_bytes += size
        return self._allocate(size)

    def give(self, buf: np.ndarray) -> None:
        self._free.append(buf)


def _pinned(nbytes: int) -> np.ndarray:
    import cupyx
    return cupyx.empty_pinned((nbytes,), np.uint8)


_PINNED_POOL: Optional[PinnedPool] = None


class DeviceCopyError(Exception):
    """A device copy's event reported a CUDA error (the message: CUDA's name
    and text for it). Raised by a device's ``done``; the backend gives up
    on the call and raises ``CommlibError`` instead."""


class CupyDevice:
    """The device side with CuPy, for one GPU: downloads and device copies
    on one side stream, uploads on another (the two copy engines run in
    parallel), both ordered after the caller's current stream; pinned
    memory from the process's pool. Tokens are CUDA events."""

    _by_id: Dict[int, "CupyDevice"] = {}

    @classmethod
    def of(cls, array) -> "CupyDevice":
        index = array.device.id
        if index not in cls._by_id:
            cls._by_id[index] = cls(index)
        return cls._by_id[index]

    def __init__(self, index: int):
        global _PINNED_POOL
        import cupy
        self._cupy = cupy
        self._gpu = cupy.cuda.Device(index)
        self._events = CudaEvents(cupy.cuda.runtime)
        with self._gpu:
            self._down = cupy.cuda.Stream(non_blocking=True)
            self._up = cupy.cuda.Stream(non_blocking=True)
        if _PINNED_POOL is None:  # pinned memory serves every GPU (unified addressing)
            _PINNED_POOL = PinnedPool(_pinned)
        self.pool = _PINNED_POOL

    bytes_of = staticmethod(byte_view)

    def follow_caller(self) -> None:
        """Later copies start after the work queued so far on the caller's stream."""
        with self._gpu:
            queued = self._cupy.cuda.get_current_stream().record()
            self._down.wait_event(queued)
            self._up.wait_event(queued)

    def sync_caller(self) -> None:
        """Wait on the host for the caller's stream (before MPI reads device memory)."""
        with self._gpu:
            self._cupy.cuda.get_current_stream().synchronize()

    def download(self, src, dst: np.ndarray):
        src.data.copy_to_host_async(ctypes.c_void_p(dst.ctypes.data), dst.nbytes, self._down)
        return self._record(self._down)

    def upload(self, src: np.ndarray, dst):
        dst.data.copy_from_host_async(ctypes.c_void_p(src.ctypes.data), src.nbytes, self._up)
        return self._record(self._up)

    def copy(self, src, dst):
        dst.data.copy_from_device_async(src.data, src.nbytes, self._down)
        return self._record(self._down)

    def _record(self, stream):
        with self._gpu:
            event = self._cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
        return event

    def done(self, token) -> bool:
        """Whether the copy is done; ``DeviceCopyError`` if CUDA reports an
        error for it (a sticky error never becomes "done")."""
        outcome = event_outcome(self._events, token)
        if isinstance(outcome, str):
            raise DeviceCopyError(outcome)
        return outcome is not None


def _host_copy(buf) -> np.ndarray:
    return np.array(buf, copy=True)


def _host_write(host: np.ndarray, buf) -> None:
    np.copyto(buf, host)


class HostCopies:
    """A device whose copies are synchronous functions: ``download(buf)``
    returns a host copy of ``buf``, ``upload(host, buf)`` writes ``host``
    into ``buf``. NumPy copies by default: the whole pipeline then runs on
    NumPy arrays standing in for device buffers (tests, CPU smoke runs)."""

    def __init__(self, download: Callable[[Any], np.ndarray] = _host_copy,
                 upload: Callable[[np.ndarray, Any], None] = _host_write):
        self._download, self._upload = download, upload
        self.pool = PinnedPool(lambda nbytes: np.empty(nbytes, np.uint8))

    bytes_of = staticmethod(byte_view)

    def follow_caller(self) -> None:
        pass

    sync_caller = follow_caller

    def download(self, src, dst: np.ndarray) -> None:
        dst[...] = self._download(src)

    def upload(self, src: np.ndarray, dst) -> None:
        self._upload(src, dst)

    def copy(self, src, dst) -> None:
        dst[...] = src

    @staticmethod
    def done(token) -> bool:
        return True


class Piece(NamedTuple):
    """Bytes (a 1-D uint8 device view) to send, and the peers that get them."""
    data: Any
    peers: Sequence[int]


def _chunks(nbytes: int, chunk: int) -> List[Tuple[int, int]]:
    return [(start, min(start + chunk, nbytes)) for start in range(0, nbytes, chunk)]


def _blocks(data, sizes: Sequence[int]) -> list:
    """``data`` cut into consecutive blocks of ``sizes`` bytes."""
    sizes = np.asarray(sizes, dtype=np.int64)
    return [data[start:start + n]
            for start, n in zip(displacements(sizes).tolist(), sizes.tolist())]


class StagedBackend:
    """The Backend methods for CUDA buffers, over ``host`` (an MpiBackend).

    ``device`` does the device side (default: ``CupyDevice`` of each call's
    buffers); ``download``/``upload`` make it a ``HostCopies`` with those
    functions. ``cuda_aware`` chooses the path (default: detected);
    ``chunk_bytes`` must be the same on every rank."""

    name = "mpi"

    def __init__(self, host, download: Optional[Callable[[Any], np.ndarray]] = None,
                 upload: Optional[Callable[[np.ndarray, Any], None]] = None, *,
                 device=None, cuda_aware: Optional[bool] = None,
                 chunk_bytes: int = CHUNK_BYTES):
        if download is not None or upload is not None:
            device = HostCopies(download or _host_copy, upload or _host_write)
        if cuda_aware is None:
            support = cuda_aware_detect()
            cuda_aware, self.reason = bool(support.aware), support.reason
        else:
            self.reason = "chosen by the caller"
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.host, self._device, self.chunk_bytes = host, device, int(chunk_bytes)
        self.cuda_aware = bool(cuda_aware)
        self.path = "cuda-aware" if self.cuda_aware else "staged"

    def __repr__(self) -> str:
        return f"StagedBackend(path={self.path!r}, reason={self.reason!r})"

    def _device_of(self, buf):
        return self._device if self._device is not None else CupyDevice.of(buf)

    # -- the Backend methods -------------------------------------------------
    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        self.start_alltoallv(send, send_bytes, out, recv_bytes)()

    def start_alltoallv(self, send, send_bytes, out, recv_bytes) -> Callable[[], None]:
        """Every message posted before this returns; the pipeline's copies
        run in the returned wait."""
        device = self._device_of(send)
        sends = _blocks(device.bytes_of(send), send_bytes)
        recvs = _blocks(device.bytes_of(out), recv_bytes)
        rank, size = self.host.rank, self.host.size
        # the host backend's order: sends in ring order from this rank
        to = [(rank + step) % size for step in range(1, size)]
        source = [(rank - step) % size for step in range(1, size)]
        return _Exchange(self, device, [Piece(sends[peer], [peer]) for peer in to],
                         [(peer, recvs[peer]) for peer in source],
                         (sends[rank], recvs[rank])).wait

    def alltoall(self, send, out) -> None:
        chunk = np.full(self.host.size, send.nbytes // self.host.size, dtype=np.int64)
        self.alltoallv(send, chunk, out, chunk)

    def prepare_alltoall(self, send, out) -> RepeatedAlltoall:
        """Each start runs an ``alltoall`` (staged or CUDA-aware alike: the
        pieces through host memory are made per call)."""
        return RepeatedAlltoall(self, send, out)

    def start_sendrecv(self, send, dest, out, source) -> Callable[[], None]:
        """Every message is posted before this returns (so that shifts
        started back to back match in order); the returned callable waits
        and copies the received chunks up."""
        device = self._device_of(send)
        return _Exchange(self, device, [Piece(device.bytes_of(send), [dest])],
                         [(source, device.bytes_of(out))]).wait

    def allgather(self, send, out) -> None:
        device = self._device_of(send)
        src, dst = device.bytes_of(send), device.bytes_of(out)
        rank, size, n = self.host.rank, self.host.size, send.nbytes
        peers = [(rank + step) % size for step in range(1, size)]
        incoming = [(peer, dst[peer * n:(peer + 1) * n]) for peer in reversed(peers)]
        _Exchange(self, device, [Piece(src, peers)], incoming,
                  (src, dst[rank * n:(rank + 1) * n])).wait()

    def bcast(self, buf, root) -> None:
        device = self._device_of(buf)
        data, rank, size = device.bytes_of(buf), self.host.rank, self.host.size
        if rank == root:
            peers = [(root + step) % size for step in range(1, size)]
            _Exchange(self, device, [Piece(data, peers)], []).wait()
        else:
            _Exchange(self, device, [], [(root, data)]).wait()

    def allreduce(self, send, out, dtype, op) -> None:
        """On the host, on either path: the reduction runs on logical values
        (bfloat16 and float8 arrive as integer storage)."""
        device = self._device_of(send)
        logical, n = np.dtype(dtype), send.nbytes
        staging = device.pool.take(2 * n)
        down, up = staging[:n], staging[n:2 * n]
        device.follow_caller()
        self._wait_for(device, device.download(device.bytes_of(send), down))
        self.host.allreduce(down.view(logical), up.view(logical), logical, op)
        self._wait_for(device, device.upload(up, device.bytes_of(out)))
        device.pool.give(staging)  # not reached on failure: MPI may still hold it

    def _wait_for(self, device, token) -> None:
        _wait(self.host.watchdog, lambda: device.done(token))


def _wait(watchdog, done: Callable[[], bool],
          pending: Callable[[], Optional[List[int]]] = lambda: None) -> None:
    """``watchdog.wait_until(done, pending)``; a device copy that failed ends
    the call at once: this rank gives up (the peers are told) and raises
    ``CommlibError`` naming the CUDA error, instead of a timeout at the
    deadline naming peers that did nothing wrong."""
    try:
        watchdog.wait_until(done, pending)
    except DeviceCopyError as error:
        reason = (f"a copy between the GPU and host memory failed with {error}. Such CUDA "
                  f"errors are usually sticky: this process cannot use its GPU any more; "
                  f"restart it")
        watchdog.give_up(reason)
        raise CommlibError(f"{watchdog.op} (call #{watchdog.calls}) on rank {watchdog.rank}: "
                           f"{reason}") from error


class _Exchange:
    """One call's point-to-point messages, in chunks.

    The constructor posts every receive, queues the downloads (staged) and
    posts every send, in chunk order per peer, before it returns: calls
    started back to back then match peer by peer. ``wait`` polls the rest
    (sends, receives, uploads) under the watchdog. ``outgoing`` are pieces
    to send, ``incoming`` (peer, device bytes) to receive, ``own`` a
    (source, target) pair copied on the device.
    """

    def __init__(self, backend: StagedBackend, device, outgoing: Sequence[Piece],
                 incoming: Sequence[Tuple[int, Any]], own: Optional[Tuple[Any, Any]] = None):
        self.host, self.device = backend.host, device
        chunk, staged = backend.chunk_bytes, not backend.cuda_aware
        outgoing = [piece for piece in outgoing if piece.peers and piece.data.nbytes]
        self.pending: List[Tuple[Any, int]] = []  # (MPI request, peer) not yet complete
        self.arrivals: List[Tuple[Any, np.ndarray, Any]] = []  # (receive, host chunk, target)
        self.copies: deque = deque()  # device copies not yet seen done, oldest first
        self.departures: deque = deque()  # (copy token, chunk, peers) not yet sent
        self.staging, used = None, 0
        if staged:
            total = (sum(target.nbytes for _, target in incoming)
                     + sum(piece.data.nbytes for piece in outgoing))
            self.staging = device.pool.take(total) if total else None

        def host_chunk(nbytes: int) -> np.ndarray:
            nonlocal used
            used += nbytes
            return self.staging[used - nbytes:used]

        try:
            # first, the caller's queued work: it may still use the memory of
            # the targets (a stream-ordered allocator reuses freed blocks)
            if staged:
                device.follow_caller()
            else:
                device.sync_caller()
            for peer, target in incoming:
                for a, b in _chunks(target.nbytes, chunk):
                    landing = host_chunk(b - a) if staged else target[a:b]
                    request = self.host.irecv(landing, peer)
                    self.pending.append((request, peer))
                    if staged:
                        self.arrivals.append((request, landing, target[a:b]))
            if own is not None and own[0].nbytes:
                self.copies.append(device.copy(*own))
            for piece in outgoing:
                for a, b in _chunks(piece.data.nbytes, chunk):
                    if staged:
                        landing = host_chunk(b - a)
                        self.departures.append((device.download(piece.data[a:b], landing),
                                                landing, piece.peers))
                    else:
                        self.departures.append((None, piece.data[a:b], piece.peers))
            self._poll_until(lambda: not self.departures)
        except BaseException:
            self.host.watchdog.hold(self)  # MPI or a copy may still use its buffers
            raise

    def wait(self) -> None:
        try:
            self._poll_until(self._finished)
        except BaseException:
            self.host.watchdog.hold(self)  # MPI or a copy may still use its buffers
            raise
        if self.staging is not None:
            self.device.pool.give(self.staging)
            self.staging = None

    def _poll_until(self, done: Callable[[], bool]) -> None:
        def step() -> bool:
            self._progress()
            return done()
        _wait(self.host.watchdog, step, self._missing)

    def _progress(self) -> None:
        """Send the chunks whose download is done (in order), start the
        upload of each chunk that arrived, forget what completed."""
        device = self.device
        while self.departures and (self.departures[0][0] is None
                                   or device.done(self.departures[0][0])):
            _, data, peers = self.departures.popleft()
            for peer in peers:
                self.pending.append((self.host.isend(data, peer), peer))
        waiting = []
        for request, landing, target in self.arrivals:
            if request.Test():
                self.copies.append(device.upload(landing, target))
            else:
                waiting.append((request, landing, target))
        self.arrivals = waiting
        self.pending = [(request, peer) for request, peer in self.pending if not request.Test()]
        while self.copies and device.done(self.copies[0]):
            self.copies.popleft()

    def _finished(self) -> bool:
        return not (self.departures or self.arrivals or self.pending or self.copies)

    def _missing(self) -> List[int]:
        return sorted({peer for request, peer in self.pending if not request.Test()})
