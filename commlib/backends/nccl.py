"""NCCL transport for CUDA (CuPy) buffers, through CuPy's NcclCommunicator.

The unique id is made on rank 0 and broadcast over MPI; every rank drives the
GPU ``local rank % visible devices``. Payloads travel as ncclUint8, and
all-to-all(v) is grouped point-to-point send/recv, as NCCL's own
alltoall is built. Counts travel over MPI (the Communicator's control plane).
Calls are stream-ordered (see ``NcclBackend``): the host does not wait for
the GPU, only for the counts an alltoallv must know, which travel over MPI.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Dict, Hashable, List, NoReturn, Optional, Set, Tuple

import numpy as np

from ..dlpack import byte_view
from ..errors import CommlibError, CommTimeoutError
from ..watchdog import TIMEOUT_ENV
from . import RepeatedAlltoall, displacements
from .inflight import IN_FLIGHT, CudaEvents, InFlight

# ncclDataType_t / ncclRedOp_t values (nccl.h); stable since NCCL 2.10
_NCCL_TYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_UINT8 = _NCCL_TYPES["uint8"]
# how long a wait for a thread inside NCCL sleeps between looks at the deadline
_WAIT_SLICE_S = 0.001


def _cuda_major() -> Optional[int]:
    """The CUDA runtime's major version CuPy was built for, or None."""
    try:
        import cupy
        return cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception:  # no CUDA runtime library, no driver
        return None


def install_hint() -> str:
    """What to pip install for NCCL, for the CUDA this CuPy runs on."""
    major = _cuda_major()
    if major in (12, 13):
        return f"pip install nvidia-nccl-cu{major}, or commlib[gpu-cu{major}]"
    return "pip install the nvidia-nccl-cuXX wheel matching your CUDA (commlib[gpu-cu12] " \
           "or commlib[gpu-cu13])"


def unavailable_reason() -> Optional[str]:
    """None when NCCL can run here, else what is missing, in words."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'commlib[gpu-cu12]' or 'commlib[gpu-cu13]')"
    try:
        from cupy.cuda import nccl
    except ImportError as error:
        return f"CuPy's NCCL module does not import ({error})"
    if not getattr(nccl, "available", False):
        return f"the NCCL library was not found ({install_hint()})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: no driver, no device
        return f"no usable CUDA device ({error})"
    if count == 0:
        return "no CUDA device is visible"
    return None


def visible_devices() -> int:
    """How many CUDA devices this process sees."""
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def current_device() -> Optional[int]:
    """The CUDA runtime's current device on this thread (what
    ``torch.cuda.set_device`` or ``cupy.cuda.Device(i).use()`` set; 0 when
    nothing did), or None when CUDA cannot say."""
    try:
        import cupy
        return cupy.cuda.runtime.getDevice()
    except Exception:  # no CuPy, no driver
        return None


def local_device(shared_rank: int, device: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
    """(the CUDA device this rank drives, None), or (None, why it has none):
    ``device`` when given, else its index among its node's ranks modulo the
    visible devices."""
    count = visible_devices()
    index = shared_rank % count if device is None else device
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
        return None, f"device={device!r} is not one of the {count} visible CUDA devices"
    return index, None


def device_identity(device_index: int) -> str:
    """Which physical GPU ``device_index`` is: host name and PCI bus id, the
    same string on every rank that drives that GPU."""
    import cupy
    from mpi4py import MPI

    return f"{MPI.Get_processor_name()} {cupy.cuda.Device(device_index).pci_bus_id}"


def shares_gpus_allowed() -> bool:
    """Whether NCCL accepts several ranks of one communicator on one GPU:
    from NCCL 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1."""
    import os

    from cupy.cuda import nccl
    return nccl.get_version() >= 23000 and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"


def shared_gpus(identities: List[str]) -> Dict[str, List[int]]:
    """GPU identity -> the ranks driving it, for GPUs driven by more than one."""
    ranks: Dict[str, List[int]] = {}
    for rank, identity in enumerate(identities):
        ranks.setdefault(identity, []).append(rank)
    return {identity: users for identity, users in ranks.items() if len(users) > 1}


def reduction_type(dtype: np.dtype) -> int:
    """The ncclDataType_t for reducing elements of ``dtype``."""
    if dtype == np.bool_:
        return _UINT8
    try:
        return _NCCL_TYPES[np.dtype(dtype).name]
    except KeyError:
        raise ValueError(f"NCCL cannot reduce {np.dtype(dtype).name}; NCCL reduces "
                         f"{', '.join(_NCCL_TYPES)}: cast first") from None


def reduction_op(dtype: np.dtype, op: str) -> int:
    """bool "sum" is logical or and "prod" logical and, as on the MPI path."""
    if dtype == np.bool_:
        op = {"sum": "max", "prod": "min"}.get(op, op)
    return _NCCL_OPS[op]


class _Guarded:
    """One NCCL communicator, launched on by one thread and aborted by whichever
    finds it failed (the in-flight thread, a deadline), never both at once:
    CuPy clears its handle only after ncclCommAbort returns, so a launch beside
    an abort would use a freed communicator. A thread inside NCCL waiting for a
    peer (init, a first connection) may never come out, so an abort never
    waits for it: that thread aborts as it comes out (ProcessGroupNCCL keeps
    the same lock per communicator). Until then nothing releases it: only a
    non-blocking communicator (``ncclConfig_t.blocking = 0``) lets
    ncclCommAbort end a call in progress, and CuPy 14's ``NcclConfig`` sets
    ``splitShare`` alone; that thread's communicator, and the kernels queued
    on it, stay until it comes out or the process ends (docs/gpu.md)."""

    def __init__(self, comm, on_abort: Callable[[], None]):
        self.comm = comm
        self.abort_wanted = False
        self._closed = False  # aborted or destroyed
        self._inside = threading.Lock()  # held by the thread inside NCCL on it
        self._on_abort = on_abort

    def use(self, work: Callable[[], None], refuse: Callable[[], NoReturn]) -> None:
        """``work()`` with the communicator to itself; ``refuse()`` once it is
        to be aborted."""
        if not self._enter():
            refuse()
        try:
            work()
        finally:
            self._leave()

    def abort(self) -> None:
        """ncclCommAbort now, or as the thread inside NCCL on it comes out."""
        self.abort_wanted = True
        self._abort_if_wanted()

    def destroy(self) -> None:
        """ncclCommDestroy, unless it is to be aborted."""
        if self._enter():
            try:
                if not self._closed:
                    self._closed = True
                    self.comm.destroy()
            finally:
                self._leave()

    def _enter(self) -> bool:
        while not self._inside.acquire(timeout=_WAIT_SLICE_S):
            if self.abort_wanted:  # never wait for a thread stuck inside
                return False
        if self.abort_wanted:
            self._leave()
            return False
        return True

    def _leave(self) -> None:
        self._inside.release()
        self._abort_if_wanted()

    def _abort_if_wanted(self) -> None:
        if not self.abort_wanted or self._closed or not self._inside.acquire(blocking=False):
            return
        try:
            if not self._closed:
                self._closed = True
                if self.comm is not None:  # None: its init failed
                    self.comm.abort()
                self._on_abort()
        finally:
            self._inside.release()


class NcclBackend:
    """Collectives on CUDA buffers over one NCCL communicator, stream-ordered:
    each call is enqueued on this backend's stream after the work already
    queued on the caller's stream (CuPy's current stream: torch's current
    stream for torch input, set by ``arrays.callers_stream``; XLA's inside
    JAX's ``jit``; else one DLPack ordered after the producer's), and the
    caller's stream waits on an event recorded after it. The host never
    waits for the GPU; ``IN_FLIGHT`` holds the buffers until the event fires
    and aborts the communicator past the deadline.

    The host does wait for peers where NCCL makes it: creating a
    communicator (every rank must join) and the first launch over each link
    (NCCL connects lazily, inside ``groupEnd``, and waits there for the
    peer). CuPy's communicators are blocking (its ``NcclConfig`` has no
    ``blocking`` field), so those calls run on a helper thread while this
    one waits under the watchdog's deadline: a peer that never arrives
    raises ``CommTimeoutError`` here instead of hanging the rank."""

    name = "nccl"

    def __init__(self, host, device_index: int, in_flight: InFlight = IN_FLIGHT):
        """Collective over ``host`` (the MPI backend), whose watchdog bounds
        every transfer on the GPU too."""
        import cupy
        from cupy.cuda import nccl

        self._build(cupy, nccl, host, device_index, in_flight, "NCCL communicator init")

    def _build(self, cupy, nccl, host, device_index: int, in_flight: InFlight,
               what: str) -> None:
        """``__init__``, given CuPy and its NCCL module."""
        self._cupy = cupy
        self._nccl = nccl
        self._host = host
        self.device_index = device_index
        self.rank, self.size = host.rank, host.size
        cupy.cuda.Device(device_index).use()
        uid = nccl.get_unique_id() if host.rank == 0 else None
        uid = host.bcast_object(uid, 0)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._attach(host.watchdog, in_flight, root=self, comm=None)

        def create() -> None:
            self._guard.comm = nccl.NcclCommunicator(host.size, uid, host.rank)
        self._within_deadline(lambda: self._guard.use(create, self._refuse),
                              f"{what} on rank {self.rank}",
                              "a peer never joined (it crashed, is stuck before it, or is in "
                              "another call)")

    def _attach(self, watchdog, in_flight: InFlight, root: "NcclBackend", comm) -> None:
        """The state every backend has besides its NCCL objects (``comm``: the
        NcclCommunicator, or None until made). ``root`` is the communicator's
        first lane, which keeps the lanes' shared fate."""
        self.watchdog = watchdog
        self._in_flight = in_flight
        self._root = root
        self._lanes: Dict[int, "NcclBackend"] = {0: self}
        self._guard = _Guarded(comm, on_abort=lambda: in_flight.forget(self))
        self._cuda = CudaEvents(self._cupy.cuda.runtime)
        self._connected: Set[Hashable] = set()  # the links NCCL has set up (see _enqueue)
        # buffers of launches captured into CUDA graphs: a graph owns no memory,
        # and commlib cannot see when the caller's graph is destroyed
        self._captured: List[tuple] = []
        watchdog.on_failure(self._abort)

    @property
    def comm(self):
        """CuPy's NcclCommunicator."""
        return self._guard.comm

    def split(self, host) -> "NcclBackend":
        return self._sibling(host, "NCCL communicator init")

    def lane(self, index: int) -> "NcclBackend":
        """A sibling on its own NCCL communicator and stream, so that its
        transfers overlap this one's (NCCL runs one communicator's operations
        in order): the ring backward's gradient hop beside the K/V rotation.
        Made on first use; every rank gets there in the same call, and makes
        it once nothing of this communicator is in flight: two NCCL
        communicators' kernels at once can deadlock (NCCL's guide), and
        creating one may synchronise the device."""
        if index not in self._lanes:
            self._quiesce()
            lane = self._sibling(self._host, f"NCCL communicator init for lane {index}")
            lane._root = self
            self._lanes[index] = lane
            if self._guard.abort_wanted:  # aborted while it was made: it goes too
                lane._abort()
        return self._lanes[index]

    def _sibling(self, host, what: str) -> "NcclBackend":
        sibling = NcclBackend.__new__(NcclBackend)
        sibling._build(self._cupy, self._nccl, host, self.device_index, self._in_flight, what)
        return sibling

    def free(self) -> None:
        """Destroy the NCCL communicators once their transfers are done (an
        aborted one is already released), and let go of the buffers kept for
        CUDA graphs captured on them: replaying such a graph after ``free()``
        is not allowed."""
        for lane in list(self._lanes.values()):
            if lane is not self:
                lane.free()
        if not self._guard.abort_wanted:
            self.watchdog.wait_until(lambda: self._in_flight.pending(self) == 0)
        self._guard.destroy()
        self._captured.clear()

    def hold_if_captured(self, *arrays) -> None:
        """Keep ``arrays`` until ``free()`` while the caller's stream is being
        captured: CuPy temporaries that a captured kernel besides NCCL's
        reads (alltoall_many's parts, a shift by 0's source)."""
        if self._cupy.cuda.get_current_stream().is_capturing():
            self._captured.append(arrays)

    def _quiesce(self) -> None:
        """Wait (under the deadline) until no lane of this communicator has a
        transfer in flight: before NCCL makes a communicator or connects a
        link, so that no kernel of another lane is running meanwhile."""
        lanes = list(self._root._lanes.values())
        self.watchdog.wait_until(
            lambda: all(self._in_flight.pending(lane) == 0 for lane in lanes))

    def _abort(self) -> None:
        """Abort the NCCL communicators, once: kernels waiting on peers return
        and NCCL lets go of the buffers; nothing more runs on them. Called by
        the watchdog on any failure, or by the in-flight thread, while the
        main thread may be adding a lane: over a copy of the lanes, taken
        once this one is marked (a lane added after it sees the mark)."""
        self._guard.abort()
        for lane in list(self._lanes.values()):
            if lane is not self:
                lane._abort()

    def _refuse(self) -> NoReturn:
        """A launch on a communicator that is being aborted: the watchdog's
        reason when it has one."""
        self.watchdog.check_usable()
        raise CommlibError("this communicator's NCCL communicator was aborted, so its calls "
                           "are refused: free it and create a new one")

    def _expire(self, what: str, error: Optional[str]) -> None:
        """In-flight thread: a transfer missed its deadline (``error`` None) or
        failed on the GPU. The watchdog makes the next call (or wait) on this
        communicator raise and tell the peers; every lane is aborted."""
        if error is None:
            reason = (f"{what} on rank {self.rank} did not finish on the GPU within "
                      f"{self.watchdog.timeout:g}s, so its NCCL communicator was aborted")
        else:
            reason = (f"{what} on rank {self.rank} failed on the GPU with {error}, so its NCCL "
                      f"communicator was aborted. Such CUDA errors are usually sticky: this "
                      f"process cannot use its GPU any more; restart it")
        sys.stderr.write(f"commlib: {reason}\n")
        # first: a launch refused by the abort gives this reason
        self.watchdog.expire(reason, timed_out=error is None)
        self._root._abort()

    def _within_deadline(self, work: Callable[[], None], what: str, why: str) -> None:
        """``work()`` on a helper thread (on this backend's device) while this
        thread waits for it under the watchdog's deadline, hearing the peers'
        notices meanwhile. Past the deadline this rank gives up (the peers are
        told, the communicator aborted, by the helper if it is inside NCCL
        and ever comes out) and raises ``CommTimeoutError``: "``what`` did not
        complete within ...: ``why``"."""
        finished = threading.Event()
        failure: List[BaseException] = []

        def run() -> None:
            try:
                self._cupy.cuda.runtime.setDevice(self.device_index)
                work()
            except BaseException as error:
                failure.append(error)
            finally:
                finished.set()
        threading.Thread(target=run, name="commlib-nccl-wait", daemon=True).start()
        timeout = self.watchdog.timeout
        deadline = time.monotonic() + timeout

        def arrived() -> bool:
            if finished.wait(_WAIT_SLICE_S):
                return True
            if time.monotonic() > deadline:
                late = f"{what} did not complete within {timeout:g}s: {why}"
                self.watchdog.give_up(late)
                raise CommTimeoutError(f"{late}. Raise {TIMEOUT_ENV} (now {timeout:g}s) if "
                                       f"the peers are only slow")
            return False
        self.watchdog.wait_until(arrived)
        if failure:
            raise failure[0]

    def _enqueue(self, launch, keep: tuple, links: Set[Hashable]) -> Callable[[], None]:
        """Run ``launch(stream)`` on our stream after the caller's queued work;
        return what makes the caller's stream wait for it. ``keep`` (the
        buffers) lives until it is done. ``links`` are what the launch needs
        connected (("send", peer), ("recv", peer), a collective's name): a
        launch that needs a new one may wait in NCCL for a peer, so it runs
        under the deadline. NCCL connects each algorithm of a collective on
        its first use, and picks the algorithm by size: a later collective of
        another size may still connect unbounded. A launch that fails leaves
        the peers waiting in theirs: give up (which tells them and aborts).
        A new link is connected only once nothing of this communicator is
        in flight (see ``lane``). While the caller's stream is captured into
        a CUDA graph nothing is watched (its events cannot be queried) and
        ``keep`` is held until ``free()``: a graph owns no memory, and its
        replays use these buffers, which CuPy's pool would hand out again."""
        self.watchdog.check_usable()
        caller = self._cupy.cuda.get_current_stream()
        capturing = caller.is_capturing()
        new = links - self._connected
        if new and not capturing:
            self._quiesce()
        self.stream.wait_event(_event(self._cupy, caller))
        if capturing:
            self._captured.append(keep)
        try:
            if new:
                self._connect(lambda: launch(self.stream.ptr), keep, _connecting(new))
            else:
                self._guard.use(lambda: launch(self.stream.ptr), self._refuse)
        except CommlibError:  # refused or timed out: the watchdog already knows
            raise
        except BaseException as error:
            self.watchdog.give_up(f"NCCL launch failed: {error}")
            raise
        self._connected |= new
        if self._guard.abort_wanted:  # aborted by another thread as it launched
            self._refuse()
        done = _event(self._cupy, self.stream)
        if not capturing:
            self._in_flight.add(self, done, keep, self.watchdog.timeout,
                                f"{self.watchdog.op} (call #{self.watchdog.calls})",
                                self._expire, device=self.device_index, cuda=self._cuda)

        def finish() -> None:
            self.watchdog.check_usable()
            self._cupy.cuda.get_current_stream().wait_event(done)
        return finish

    def _connect(self, launch: Callable[[], None], keep: tuple, why: str) -> None:
        """A launch that connects, under the deadline. Given up on, its helper
        may still launch once NCCL lets it out: ``keep`` is held for the life
        of the communicator."""
        try:
            self._within_deadline(lambda: self._guard.use(launch, self._refuse),
                                  f"{self.watchdog.op} (call #{self.watchdog.calls}) on rank "
                                  f"{self.rank}", why)
        except CommlibError:
            self.watchdog.hold(*keep)
            raise

    def _run(self, op: str, launch, *keep) -> None:
        self._enqueue(launch, keep, {op})()

    def _grouped(self, sends, recvs, keep: tuple) -> Callable[[], None]:
        """One NCCL group of point-to-point transfers: (pointer, nbytes, peer)."""
        def launch(stream):
            self._nccl.groupStart()
            try:
                for ptr, nbytes, peer in sends:
                    if nbytes:
                        self.comm.send(ptr, nbytes, _UINT8, peer, stream)
                for ptr, nbytes, peer in recvs:
                    if nbytes:
                        self.comm.recv(ptr, nbytes, _UINT8, peer, stream)
            finally:  # NCCL's group depth is per thread: always close it
                self._nccl.groupEnd()
        links = {("send", peer) for _, nbytes, peer in sends if nbytes} | \
            {("recv", peer) for _, nbytes, peer in recvs if nbytes}
        return self._enqueue(launch, keep, links)

    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        self.start_alltoallv(send, send_bytes, out, recv_bytes)()

    def start_alltoallv(self, send, send_bytes, out, recv_bytes) -> Callable[[], None]:
        """Enqueued at once, like ``start_sendrecv``."""
        send_bytes, recv_bytes = np.asarray(send_bytes), np.asarray(recv_bytes)
        sbase, rbase = byte_view(send).data.ptr, byte_view(out).data.ptr
        sdispl, rdispl = displacements(send_bytes), displacements(recv_bytes)
        return self._grouped(
            [(sbase + int(sdispl[p]), int(send_bytes[p]), p) for p in range(self.size)],
            [(rbase + int(rdispl[p]), int(recv_bytes[p]), p) for p in range(self.size)],
            (send, out))

    def alltoall(self, send, out) -> None:
        chunk = send.nbytes // self.size
        counts = np.full(self.size, chunk, dtype=np.int64)
        self.alltoallv(send, counts, out, counts)

    def prepare_alltoall(self, send, out) -> RepeatedAlltoall:
        """Each start enqueues an ``alltoall`` (NCCL has no persistent
        collective; the host does not wait for it)."""
        return RepeatedAlltoall(self, send, out)

    def start_sendrecv(self, send, dest, out, source) -> Callable[[], None]:
        """Enqueued at once; the returned callable makes the caller's stream
        wait for it (the host does not)."""
        return self._grouped([(send.data.ptr, send.nbytes, dest)],
                             [(out.data.ptr, out.nbytes, source)], (send, out))

    def allgather(self, send, out) -> None:
        self._run("allgather", lambda s: self.comm.allGather(
            send.data.ptr, out.data.ptr, send.nbytes, _UINT8, s), send, out)

    def allreduce(self, send, out, dtype, op) -> None:
        nccl_type = reduction_type(dtype)
        self._run("allreduce", lambda s: self.comm.allReduce(
            send.data.ptr, out.data.ptr, send.size, nccl_type, reduction_op(dtype, op), s),
            send, out)

    def bcast(self, buf, root) -> None:
        self._run("bcast", lambda s: self.comm.bcast(
            buf.data.ptr, buf.nbytes, _UINT8, root, s), buf)


def _connecting(links: Set[Hashable]) -> str:
    """Why a launch that set up ``links`` did not complete, in words."""
    peers = sorted({link[1] for link in links if isinstance(link, tuple)})
    where = f"to rank(s) {', '.join(map(str, peers))}" if peers else \
        f"its peers for its first {', '.join(sorted(map(str, links)))} on this communicator"
    return (f"NCCL was still connecting {where} (a peer that never reached the same call: it "
            f"crashed, is stuck elsewhere, or is in another call)")


def _event(cupy, stream):
    """An event recorded on ``stream`` now (no timing: cheaper)."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event
