"""Transports under the Communicator.

A backend moves the bytes of C-contiguous arrays that the Communicator has
already validated and allocated; it never allocates results or checks user
input. ``mpi`` carries host arrays and all control traffic (count exchanges,
error reports); ``nccl`` carries CUDA arrays; ``staged`` carries them over
MPI, through host memory or, where MPI reads CUDA memory, directly
(``cuda_aware``). A new transport (UCC, say) is one new module with the
methods of ``Backend`` plus the line of ``Communicator._transport`` that
selects it (docs/architecture.md, "Adding a transport").
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

REDUCE_OPS = ("sum", "prod", "max", "min")


class PreparedExchange(Protocol):
    """An all-to-all of two fixed arrays, set up once: ``start()`` begins
    one and returns its wait."""

    def start(self) -> Callable[[], None]: ...


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

    def prepare_alltoall(self, send: Any, out: Any) -> PreparedExchange:
        """``alltoall(send, out)`` set up once to run many times on these two
        arrays (a persistent collective where the transport has one)."""

    def start_sendrecv(self, send: Any, dest: int, out: Any,
                       source: int) -> Callable[[], None]:
        """Start sending to ``dest`` while receiving from ``source``; the
        returned callable waits for both."""

    def allgather(self, send: Any, out: Any) -> None: ...

    def allreduce(self, send: Any, out: Any, dtype: np.dtype, op: str) -> None:
        """Element-wise reduction; ``dtype`` is the logical element type."""

    def bcast(self, buf: Any, root: int) -> None: ...


class RepeatedAlltoall:
    """``prepare_alltoall`` of a transport without persistent collectives:
    each ``start()`` runs its ``alltoall`` (finished, or ordered on the
    caller's stream, when it returns), so the wait has nothing left to do."""

    def __init__(self, backend: Backend, send: Any, out: Any):
        self._backend, self._send, self._out = backend, send, out

    def start(self) -> Callable[[], None]:
        self._backend.alltoall(self._send, self._out)
        return _done


def _done() -> None:
    """The wait of an exchange that has finished, or is ordered on its stream."""


def displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each rank's block starts."""
    return np.cumsum(counts) - counts
