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
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ..arrays import byte_view
from . import displacements
from .inflight import IN_FLIGHT, InFlight

# ncclDataType_t / ncclRedOp_t values (nccl.h); stable since NCCL 2.10
_NCCL_TYPES = {
    "int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}
_UINT8 = _NCCL_TYPES["uint8"]


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


class NcclBackend:
    """Collectives on CUDA buffers over one NCCL communicator, stream-ordered:
    each call is enqueued on this backend's stream after the work already
    queued on the caller's stream (CuPy's current stream, which DLPack has
    ordered after the torch or JAX stream the arrays came from), and the
    caller's stream waits on an event recorded after it. The host never
    waits for the GPU; ``IN_FLIGHT`` holds the buffers until the event fires
    and aborts the communicator past the deadline."""

    name = "nccl"

    def __init__(self, host, device_index: int, in_flight: InFlight = IN_FLIGHT):
        """Collective over ``host`` (the MPI backend), whose watchdog bounds
        every transfer on the GPU too."""
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self._host = host
        self.device_index = device_index
        cupy.cuda.Device(device_index).use()
        uid = nccl.get_unique_id() if host.rank == 0 else None
        uid = host.bcast_object(uid, 0)
        self.comm = nccl.NcclCommunicator(host.size, uid, host.rank)
        self.rank, self.size = host.rank, host.size
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._attach(host.watchdog, in_flight, root=self)

    def _attach(self, watchdog, in_flight: InFlight, root: "NcclBackend") -> None:
        """The state every backend has besides its NCCL objects. ``root`` is
        the communicator's first lane, which keeps the lanes' shared fate."""
        self.watchdog = watchdog
        self._in_flight = in_flight
        self._root = root
        self._lanes: Dict[int, "NcclBackend"] = {0: self}
        self._abort_lock = threading.Lock()
        self._aborted = False
        watchdog.on_failure(self._abort)

    def split(self, host) -> "NcclBackend":
        return NcclBackend(host, self.device_index, self._in_flight)

    def lane(self, index: int) -> "NcclBackend":
        """A sibling on its own NCCL communicator and stream, so that its
        transfers overlap this one's (NCCL runs one communicator's operations
        in order): the ring backward's gradient hop beside the K/V rotation.
        Made on first use; every rank gets there in the same call."""
        if index not in self._lanes:
            lane = NcclBackend(self._host, self.device_index, self._in_flight)
            lane._root = self
            self._lanes[index] = lane
        return self._lanes[index]

    def free(self) -> None:
        """Destroy the NCCL communicators once their transfers are done (an
        aborted one is already released)."""
        for lane in self._lanes.values():
            if lane is not self:
                lane.free()
        if not self._aborted:
            self.watchdog.wait_until(lambda: self._in_flight.pending(self) == 0)
        if not self._aborted:
            self.comm.destroy()

    def _abort(self) -> None:
        """Abort the NCCL communicators, once: kernels waiting on peers return
        and NCCL lets go of the buffers; nothing more runs on them. Called by
        the watchdog on any failure, or by the in-flight thread."""
        for lane in self._lanes.values():
            if lane is not self:
                lane._abort()
        with self._abort_lock:
            if self._aborted:
                return
            self._aborted = True
        self.comm.abort()
        self._in_flight.forget(self)

    def _expire(self, what: str) -> None:
        """In-flight thread: a transfer missed its deadline. Abort every lane
        now; the watchdog makes the next call (or wait) on this communicator
        raise and tell the peers."""
        late = (f"{what} on rank {self.rank} did not finish on the GPU within "
                f"{self.watchdog.timeout:g}s, so its NCCL communicator was aborted")
        sys.stderr.write(f"commlib: {late}\n")
        self._root._abort()
        self.watchdog.expire(late)

    def _enqueue(self, launch, keep: tuple) -> Callable[[], None]:
        """Run ``launch(stream)`` on our stream after the caller's queued work;
        return what makes the caller's stream wait for it. ``keep`` (the
        buffers) lives until it is done. A launch that fails leaves the peers
        waiting in theirs: give up (which tells them and aborts)."""
        self.watchdog.check_usable()
        self.stream.wait_event(_event(self._cupy, self._cupy.cuda.get_current_stream()))
        try:
            launch(self.stream.ptr)
        except BaseException as error:
            self.watchdog.give_up(f"NCCL launch failed: {error}")
            raise
        done = _event(self._cupy, self.stream)
        self._in_flight.add(self, done, keep, self.watchdog.timeout,
                            f"{self.watchdog.op} (call #{self.watchdog.calls})", self._expire)

        def finish() -> None:
            self.watchdog.check_usable()
            self._cupy.cuda.get_current_stream().wait_event(done)
        return finish

    def _run(self, launch, *keep) -> None:
        self._enqueue(launch, keep)()

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
        return self._enqueue(launch, keep)

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

    def start_sendrecv(self, send, dest, out, source) -> Callable[[], None]:
        """Enqueued at once; the returned callable makes the caller's stream
        wait for it (the host does not)."""
        return self._grouped([(send.data.ptr, send.nbytes, dest)],
                             [(out.data.ptr, out.nbytes, source)], (send, out))

    def allgather(self, send, out) -> None:
        self._run(lambda s: self.comm.allGather(send.data.ptr, out.data.ptr, send.nbytes,
                                                _UINT8, s), send, out)

    def allreduce(self, send, out, dtype, op) -> None:
        nccl_type = reduction_type(dtype)
        self._run(lambda s: self.comm.allReduce(send.data.ptr, out.data.ptr, send.size,
                                                nccl_type, reduction_op(dtype, op), s),
                  send, out)

    def bcast(self, buf, root) -> None:
        self._run(lambda s: self.comm.bcast(buf.data.ptr, buf.nbytes, _UINT8, root, s), buf)


def _event(cupy, stream):
    """An event recorded on ``stream`` now (no timing: cheaper)."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event
