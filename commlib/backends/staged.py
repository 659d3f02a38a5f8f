"""CUDA buffers over MPI, staged through host memory: what a communicator
without NCCL uses for CUDA arrays (several ranks sharing one GPU, or no NCCL
library), so that such a run still moves GPU data, only slower.

Each call waits for the device's pending work (the caller's current CuPy
stream), copies the device buffers to the host, runs the MPI operation of
the host backend there, and copies the results back. Deadlines, failure
notices and cross-rank checks are the host backend's, unchanged. A
CUDA-aware MPI could take device buffers directly; that is not detected
yet, so every call stages.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def _download(buf) -> np.ndarray:
    """A host copy of a CuPy buffer, after the work queued before it."""
    import cupy
    cupy.cuda.get_current_stream().synchronize()
    return cupy.asnumpy(buf)


def _upload(host: np.ndarray, buf) -> None:
    """``host`` into the CuPy buffer ``buf``, finished when this returns."""
    import cupy
    buf.set(host)
    cupy.cuda.get_current_stream().synchronize()


class StagedBackend:
    """The Backend methods for device buffers, over ``host`` (an MpiBackend).
    ``download``/``upload`` move a buffer between device and host (CuPy's,
    by default; tests pass NumPy copies)."""

    name = "mpi"

    def __init__(self, host, download: Callable[[Any], np.ndarray] = _download,
                 upload: Callable[[np.ndarray, Any], None] = _upload):
        self.host, self._download, self._upload = host, download, upload

    def _empty_like(self, buf) -> np.ndarray:
        return np.empty(buf.shape, buf.dtype)

    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        staged = self._empty_like(out)
        self.host.alltoallv(self._download(send), send_bytes, staged, recv_bytes)
        self._upload(staged, out)

    def alltoall(self, send, out) -> None:
        staged = self._empty_like(out)
        self.host.alltoall(self._download(send), staged)
        self._upload(staged, out)

    def start_sendrecv(self, send, dest, out, source) -> Callable[[], None]:
        staged = self._empty_like(out)
        wait = self.host.start_sendrecv(self._download(send), dest, staged, source)

        def finish() -> None:
            wait()
            self._upload(staged, out)
        return finish

    def allgather(self, send, out) -> None:
        staged = self._empty_like(out)
        self.host.allgather(self._download(send), staged)
        self._upload(staged, out)

    def allreduce(self, send, out, dtype, op) -> None:
        # bfloat16 and float8 live on the device as integer storage: reduce
        # their logical values on the host
        logical = np.dtype(dtype)
        staged = np.empty(out.shape, logical)
        self.host.allreduce(self._download(send).view(logical), staged, logical, op)
        self._upload(staged.view(out.dtype), out)

    def bcast(self, buf, root) -> None:
        staged = self._download(buf)
        self.host.bcast(staged, root)
        self._upload(staged, buf)
