"""MPI transport over mpi4py, for host (NumPy) buffers, and commlib's
control plane: count exchanges and error reports for every backend.

Payloads travel as ``MPI.BYTE``, so bool, bfloat16 and float8 need no
datatype table; only ``allreduce`` looks at element types.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, List

import numpy as np
from mpi4py import MPI

from ..arrays import byte_view

_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
# bool reductions run on uint8: "sum" is logical or, "prod" logical and
_BOOL_OPS = {"sum": MPI.MAX, "prod": MPI.MIN, "max": MPI.MAX, "min": MPI.MIN}


def _reduction_type(dtype: np.dtype):
    """(MPI datatype, dtype to compute in) for an element-wise reduction.

    Types MPI has no datatype for (float16, bfloat16, float8) are reduced in
    float32 and rounded back once: more accurate than a chain of half
    precision additions, and identical on every rank.
    """
    if dtype == np.bool_:
        return MPI.UINT8_T, np.dtype(np.uint8)
    if dtype.kind == "V" or (dtype.kind == "f" and dtype.itemsize < 4):
        return MPI.FLOAT, np.dtype(np.float32)
    predefined = MPI._typedict.get(dtype.char)  # mpi4py's NumPy char -> MPI datatype table
    if predefined is None:
        raise ValueError(f"allreduce cannot reduce {dtype.name} over MPI; cast to a "
                         f"standard integer or float type first")
    return predefined, dtype


def _starts(counts: List[int]) -> List[int]:
    """Exclusive prefix sum: where each rank's block starts."""
    return list(accumulate(counts[:-1], initial=0))


class MpiBackend:
    """Collectives on host buffers over one MPI communicator."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()

    # -- payload ---------------------------------------------------------
    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        # mpi4py converts Python lists of counts faster than int64 arrays
        send_list, recv_list = send_bytes.tolist(), recv_bytes.tolist()
        self.comm.Alltoallv([byte_view(send), (send_list, _starts(send_list)), MPI.BYTE],
                            [byte_view(out), (recv_list, _starts(recv_list)), MPI.BYTE])

    def alltoall(self, send, out) -> None:
        self.comm.Alltoall([byte_view(send), MPI.BYTE], [byte_view(out), MPI.BYTE])

    def sendrecv(self, send, dest, out, source) -> None:
        requests = [self.comm.Irecv([byte_view(out), MPI.BYTE], source=source),
                    self.comm.Isend([byte_view(send), MPI.BYTE], dest=dest)]
        MPI.Request.Waitall(requests)

    def allgather(self, send, out) -> None:
        self.comm.Allgather([byte_view(send), MPI.BYTE], [byte_view(out), MPI.BYTE])

    def allreduce(self, send, out, dtype, op) -> None:
        mpi_type, compute = _reduction_type(np.dtype(dtype))
        mpi_op = (_BOOL_OPS if dtype == np.bool_ else _OPS)[op]
        if compute == send.dtype:
            self.comm.Allreduce([send, mpi_type], [out, mpi_type], op=mpi_op)
            return
        wide_out = np.empty(send.shape, compute)
        self.comm.Allreduce([send.astype(compute), mpi_type], [wide_out, mpi_type], op=mpi_op)
        out[...] = wide_out.astype(out.dtype)

    def bcast(self, buf, root) -> None:
        self.comm.Bcast([byte_view(buf), MPI.BYTE], root=root)

    def barrier(self) -> None:
        self.comm.Barrier()

    # -- control plane ---------------------------------------------------
    def exchange_int64(self, rows: np.ndarray) -> np.ndarray:
        """Row i of ``rows`` (shape [size, k]) goes to rank i; returns the
        [size, k] rows received, row i from rank i."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        received = np.empty_like(rows)
        self.comm.Alltoall(rows, received)
        return received

    def allgather_object(self, obj: Any) -> List[Any]:
        return self.comm.allgather(obj)

    def bcast_object(self, obj: Any, root: int) -> Any:
        return self.comm.bcast(obj, root=root)
