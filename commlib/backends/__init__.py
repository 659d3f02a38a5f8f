"""Transports under the Communicator.

A backend moves the bytes of C-contiguous arrays that the Communicator has
already validated and allocated; it never allocates results or checks user
input. ``mpi`` carries host arrays and all control traffic (count exchanges,
error reports); ``nccl`` carries CUDA arrays. A new transport (UCC, a
CUDA-aware MPI) is one new module with the methods of ``Backend``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

REDUCE_OPS = ("sum", "prod", "max", "min")


class Backend(Protocol):
    name: str

    def alltoallv(self, send: Any, send_bytes: Sequence[int], out: Any,
                  recv_bytes: Sequence[int]) -> None:
        """Send ``send_bytes[i]`` bytes (in rank order) to rank i; receive
        ``recv_bytes[i]`` bytes from rank i into ``out``, in rank order."""

    def start_alltoallv(self, send: Any, send_bytes: Sequence[int], out: Any,
                        recv_bytes: Sequence[int]) -> Callable[[], None]:
        """``alltoallv`` started; the returned callable waits for it."""

    def alltoall(self, send: Any, out: Any) -> None:
        """Equal byte chunks, chunk i to rank i."""

    def start_sendrecv(self, send: Any, dest: int, out: Any,
                       source: int) -> Callable[[], None]:
        """Start sending to ``dest`` while receiving from ``source``; the
        returned callable waits for both."""

    def allgather(self, send: Any, out: Any) -> None: ...

    def allreduce(self, send: Any, out: Any, dtype: np.dtype, op: str) -> None:
        """Element-wise reduction; ``dtype`` is the logical element type."""

    def bcast(self, buf: Any, root: int) -> None: ...


def displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each rank's block starts."""
    return np.cumsum(counts) - counts
