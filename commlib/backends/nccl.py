"""NCCL transport for CUDA (CuPy) buffers, through CuPy's NcclCommunicator.

The unique id is made on rank 0 and broadcast over MPI; every rank drives the
GPU ``local rank % visible devices``. Payloads travel as ncclUint8, and
all-to-all(v) is grouped point-to-point send/recv, as NCCL's own
alltoall is built. Counts travel over MPI (the Communicator's control plane).
Everything runs on one stream per communicator, which is synchronized before
a call returns, so results are ready in any stream the caller uses next.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from ..arrays import byte_view
from . import displacements

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
    """Collectives on CUDA buffers over one NCCL communicator."""

    name = "nccl"

    def __init__(self, host, device_index: int):
        """Collective over ``host`` (the MPI backend), whose watchdog bounds
        every wait on the GPU too."""
        import cupy
        from cupy.cuda import nccl

        self._cupy = cupy
        self._nccl = nccl
        self.device_index = device_index
        cupy.cuda.Device(device_index).use()
        uid = nccl.get_unique_id() if host.rank == 0 else None
        uid = host.bcast_object(uid, 0)
        self.comm = nccl.NcclCommunicator(host.size, uid, host.rank)
        self.rank, self.size = host.rank, host.size
        self.watchdog = host.watchdog
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._aborted = False

    def split(self, host) -> "NcclBackend":
        return NcclBackend(host, self.device_index)

    def free(self) -> None:
        if not self._aborted:  # an aborted communicator is already released
            self.comm.destroy()

    def _abort(self) -> None:
        """Abort the NCCL communicator, once: kernels waiting on peers return
        and NCCL lets go of the buffers; nothing more runs on it."""
        if not self._aborted:
            self._aborted = True
            self.comm.abort()

    def _run(self, launch) -> None:
        self._launch(launch)
        self._wait()

    def _launch(self, launch) -> None:
        """Order the call after the caller's current stream, on ours. A launch
        that fails leaves the peers waiting in theirs: tell them, abort."""
        self.stream.wait_event(self._cupy.cuda.get_current_stream().record())
        try:
            launch(self.stream.ptr)
        except BaseException as error:
            self.watchdog.give_up(f"NCCL launch failed: {error}")
            self._abort()
            raise

    def _wait(self) -> None:
        """Until our stream is done, under the deadline. Whatever ends the
        wait early (the deadline, a peer's failure notice, an interrupt)
        aborts the NCCL communicator, so that no kernel spins on a peer that
        will never come and no buffer is reused while NCCL still owns it."""
        try:
            self.watchdog.wait_until(lambda: self.stream.done)
        except BaseException:
            self._abort()
            raise

    def _grouped(self, sends, recvs) -> None:
        self._launch_grouped(sends, recvs)
        self._wait()

    def _launch_grouped(self, sends, recvs) -> None:
        """One NCCL group of point-to-point transfers: (buffer, nbytes, peer)."""
        def launch(stream):
            self._nccl.groupStart()
            try:
                for buf, nbytes, peer in sends:
                    if nbytes:
                        self.comm.send(buf, nbytes, _UINT8, peer, stream)
                for buf, nbytes, peer in recvs:
                    if nbytes:
                        self.comm.recv(buf, nbytes, _UINT8, peer, stream)
            finally:  # NCCL's group depth is per thread: always close it
                self._nccl.groupEnd()
        self._launch(launch)

    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        sbase, rbase = byte_view(send).data.ptr, byte_view(out).data.ptr
        sdispl, rdispl = displacements(send_bytes), displacements(recv_bytes)
        self._grouped(
            [(sbase + int(sdispl[p]), int(send_bytes[p]), p) for p in range(self.size)],
            [(rbase + int(rdispl[p]), int(recv_bytes[p]), p) for p in range(self.size)])

    def alltoall(self, send, out) -> None:
        chunk = send.nbytes // self.size
        counts = np.full(self.size, chunk, dtype=np.int64)
        self.alltoallv(send, counts, out, counts)

    def start_sendrecv(self, send, dest, out, source):
        """Launched on this communicator's stream; the returned callable waits."""
        self._launch_grouped([(send.data.ptr, send.nbytes, dest)],
                             [(out.data.ptr, out.nbytes, source)])
        return self._wait

    def allgather(self, send, out) -> None:
        self._run(lambda s: self.comm.allGather(send.data.ptr, out.data.ptr, send.nbytes,
                                                _UINT8, s))

    def allreduce(self, send, out, dtype, op) -> None:
        nccl_type = reduction_type(dtype)
        self._run(lambda s: self.comm.allReduce(send.data.ptr, out.data.ptr, send.size,
                                                nccl_type, reduction_op(dtype, op), s))

    def bcast(self, buf, root) -> None:
        self._run(lambda s: self.comm.bcast(buf.data.ptr, buf.nbytes, _UINT8, root, s))
