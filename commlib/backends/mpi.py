"""MPI transport over mpi4py, for host (NumPy) buffers, and commlib's
control plane: count exchanges and error reports for every backend.

Payloads travel as ``MPI.BYTE``, so bool, bfloat16 and float8 need no
datatype table; only ``allreduce`` looks at element types. Every operation
is nonblocking and waited on by the communicator's Watchdog, so that each
has a deadline and hears about failed peers. The variable all-to-all is
pairwise ``Isend``/``Irecv``: it names the peers not heard from, and
measured faster than MPICH's own ``Ialltoallv`` here (docs/reliability.md);
equal chunks take MPI's ``Ialltoall``, the fastest for small messages.
"""

from __future__ import annotations

import pickle
import weakref
from itertools import accumulate
from typing import Any, Callable, List, Sequence

import numpy as np
from mpi4py import MPI

from ..dlpack import byte_view
from ..watchdog import Watchdog

_OPS = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
# bool reductions run on uint8: "sum" is logical or, "prod" logical and
_BOOL_OPS = {"sum": MPI.MAX, "prod": MPI.MIN, "max": MPI.MAX, "min": MPI.MIN}
_PAYLOAD_TAG = 0
# chunked device payloads (backends.staged): a tag of their own, so that a
# rank sending host arrays can never match a peer's chunked CUDA transfer
CHUNK_TAG = 1


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


# bytes per peer up to which equal chunks take MPI's Ialltoall
IALLTOALL_MAX_BYTES = 1 << 20
# the control plane's usual all-to-alls: one int64 per peer (agreement) and
# two (alltoallv's row count and signature)
HEADER_WIDTHS = (1, 2)


class _PersistentExchange:
    """An all-to-all of ``width`` int64 per peer on fixed buffers, set up
    once (MPI 4's ``Alltoall_init``): starting it costs about half of a new
    ``Ialltoall`` (3.5 vs 5.9 us at 2 ranks), and every call of every
    collective pays one. Falls back to ``Ialltoall`` where MPI lacks it."""

    def __init__(self, comm: MPI.Comm, width: int):
        size = comm.Get_size()
        self._out = np.zeros((size, width), np.int64)
        self._in = np.zeros((size, width), np.int64)
        self._comm = comm
        try:
            self._request = comm.Alltoall_init([self._out, MPI.INT64_T],
                                               [self._in, MPI.INT64_T])
        except NotImplementedError:
            self._request = None

    def exchange(self, rows: np.ndarray, wait: Callable[[Any], None]) -> np.ndarray:
        self._out[...] = rows
        if self._request is None:
            wait(self._comm.Ialltoall([self._out, MPI.INT64_T], [self._in, MPI.INT64_T]))
        else:
            self._request.Start()
            wait(self._request)
        return self._in.copy()

    def free(self) -> None:
        if self._request is not None:
            self._request.Free()


class _PreparedAlltoall:
    """An all-to-all of one pair of host buffers, set up once to run many
    times: MPI 4's persistent ``Alltoall_init`` up to
    ``IALLTOALL_MAX_BYTES`` a peer (``Ialltoall`` where MPI lacks it), the
    pairwise loop above. ``start()`` begins one and returns its wait. The
    request is freed with this object, or with the backend, whichever is
    first."""

    def __init__(self, backend: "MpiBackend", send: np.ndarray, out: np.ndarray):
        self._backend, self._request, self._active = backend, None, False
        chunk = send.nbytes // backend.size
        sizes = [chunk] * backend.size
        if chunk > IALLTOALL_MAX_BYTES:
            self.start = lambda: backend.start_alltoallv(send, sizes, out, sizes)
            return
        buffers = ([byte_view(send), MPI.BYTE], [byte_view(out), MPI.BYTE])
        try:
            self._request = backend.comm.Alltoall_init(*buffers)
        except NotImplementedError:
            self.start = lambda: backend.wait_on(backend.comm.Ialltoall(*buffers))
        self._buffers = (send, out)  # MPI writes into them until the request is freed

    def start(self) -> Callable[[], None]:
        self._request.Start()
        self._active = True

        def wait() -> None:
            self._backend.wait_on(self._request)()
            self._active = False
        return wait

    def free(self) -> None:
        """Free the request, unless an exchange on it never finished (then
        MPI may still write into the buffers: both stay held)."""
        if self._request is not None and not self._active:
            self._request, request = None, self._request
            request.Free()

    def __del__(self):
        if self._backend.watchdog.failure is None and self._backend.watchdog.freed is None:
            self.free()


def _ints(sizes: Sequence[int]) -> List[int]:
    """Byte counts as a list of Python ints (the communicator passes lists;
    a NumPy array, as tests pass, works too)."""
    return sizes.tolist() if isinstance(sizes, np.ndarray) else list(sizes)


def _starts(counts: List[int]) -> List[int]:
    """Exclusive prefix sum: where each rank's block starts."""
    return list(accumulate(counts[:-1], initial=0))


class MpiBackend:
    """Collectives on host buffers over one MPI communicator."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm, timeout: float):
        """Takes ownership of ``comm``; failure notices travel on a duplicate
        of it, so they never match payload messages."""
        self.comm = comm
        self.watchdog = Watchdog(comm.Dup(), timeout)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._headers = {width: _PersistentExchange(comm, width) for width in HEADER_WIDTHS}
        self._prepared: "weakref.WeakSet[_PreparedAlltoall]" = weakref.WeakSet()

    def free(self) -> None:
        """Collective. The communicators are freed only where nothing more
        can arrive on them (``Watchdog.close``)."""
        prepared = list(self._prepared)
        if self.watchdog.failure is None:
            for exchange in [*self._headers.values(), *prepared]:
                exchange.free()
        else:  # a failed call may have left one active, writing into its buffers
            self.watchdog.hold(*self._headers.values(), *prepared)
        self.watchdog.close(self.comm)

    # -- payload ---------------------------------------------------------
    def alltoallv(self, send, send_bytes, out, recv_bytes) -> None:
        self.start_alltoallv(send, send_bytes, out, recv_bytes)()

    def start_alltoallv(self, send, send_bytes, out, recv_bytes) -> Callable[[], None]:
        """Pairwise: receives posted first, sends in ring order from this
        rank (so that not everyone sends to rank 0 first), own block copied.
        Returns the wait."""
        sizes_out, sizes_in = _ints(send_bytes), _ints(recv_bytes)
        starts_out, starts_in = _starts(sizes_out), _starts(sizes_in)
        src, dst = byte_view(send), byte_view(out)
        comm, rank, size = self.comm, self.rank, self.size
        requests, peers = [], []
        for step in range(1, size):
            peer = (rank - step) % size
            if sizes_in[peer]:
                begin = starts_in[peer]
                requests.append(comm.Irecv([dst[begin:begin + sizes_in[peer]], MPI.BYTE],
                                           peer, _PAYLOAD_TAG))
                peers.append(peer)
        for step in range(1, size):
            peer = (rank + step) % size
            if sizes_out[peer]:
                begin = starts_out[peer]
                requests.append(comm.Isend([src[begin:begin + sizes_out[peer]], MPI.BYTE],
                                           peer, _PAYLOAD_TAG))
                peers.append(peer)
        own_in, own_out = starts_in[rank], starts_out[rank]
        dst[own_in:own_in + sizes_in[rank]] = src[own_out:own_out + sizes_out[rank]]
        return lambda: self.watchdog.wait_requests(requests, peers)

    def alltoall(self, send, out) -> None:
        """Equal chunks: MPI's own all-to-all, one request, up to
        ``IALLTOALL_MAX_BYTES`` a peer (a third of the pairwise loop's cost
        at 1 KiB, 10% less at 1 MiB); the pairwise loop above (17% less at
        16 MiB; measured at 2 ranks, MPICH)."""
        chunk = send.nbytes // self.size
        if chunk > IALLTOALL_MAX_BYTES:
            self.alltoallv(send, [chunk] * self.size, out, [chunk] * self.size)
            return
        self._wait(self.comm.Ialltoall([byte_view(send), MPI.BYTE], [byte_view(out), MPI.BYTE]))

    def prepare_alltoall(self, send, out) -> _PreparedAlltoall:
        """``alltoall(send, out)`` set up once for many ``start()`` calls."""
        prepared = _PreparedAlltoall(self, send, out)
        self._prepared.add(prepared)
        return prepared

    def wait_on(self, request) -> Callable[[], None]:
        """The wait of a started request, under the watchdog."""
        return lambda: self._wait(request)

    def start_sendrecv(self, send, dest, out, source) -> Callable[[], None]:
        requests = [self.comm.Irecv([byte_view(out), MPI.BYTE], source, _PAYLOAD_TAG),
                    self.comm.Isend([byte_view(send), MPI.BYTE], dest, _PAYLOAD_TAG)]
        return lambda: self.watchdog.wait_requests(requests, [source, dest])

    def allgather(self, send, out) -> None:
        self._wait(self.comm.Iallgather([byte_view(send), MPI.BYTE], [byte_view(out), MPI.BYTE]))

    def allreduce(self, send, out, dtype, op) -> None:
        mpi_type, compute = _reduction_type(np.dtype(dtype))
        mpi_op = (_BOOL_OPS if dtype == np.bool_ else _OPS)[op]
        if compute == send.dtype:
            self._wait(self.comm.Iallreduce([send, mpi_type], [out, mpi_type], op=mpi_op))
            return
        wide_out = np.empty(send.shape, compute)
        self._wait(self.comm.Iallreduce([send.astype(compute), mpi_type], [wide_out, mpi_type],
                                        op=mpi_op))
        out[...] = wide_out.astype(out.dtype)

    def bcast(self, buf, root) -> None:
        self._wait(self.comm.Ibcast([byte_view(buf), MPI.BYTE], root=root))

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier())

    def _wait(self, request) -> None:
        self.watchdog.wait_requests([request])

    # -- single messages, for pipelines built on top (backends.staged) -----
    def isend(self, buf, peer: int, tag: int = CHUNK_TAG):
        """Start sending the bytes of ``buf`` to ``peer``; the request is the
        caller's to wait on (through ``watchdog.wait_until``)."""
        return self.comm.Isend([byte_view(buf), MPI.BYTE], peer, tag)

    def irecv(self, buf, peer: int, tag: int = CHUNK_TAG):
        """Start receiving ``buf.nbytes`` bytes from ``peer`` into ``buf``."""
        return self.comm.Irecv([byte_view(buf), MPI.BYTE], peer, tag)

    # -- control plane ---------------------------------------------------
    def exchange_int64(self, rows: np.ndarray) -> np.ndarray:
        """Row i of ``rows`` (shape [size, k]) goes to rank i; returns the
        [size, k] rows received, row i from rank i."""
        persistent = self._headers.get(rows.shape[1])
        if persistent is not None:
            return persistent.exchange(rows, self._wait)
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        received = np.empty_like(rows)
        self._wait(self.comm.Ialltoall(rows, received))
        return received

    def allgather_object(self, obj: Any) -> List[Any]:
        """Every rank's picklable ``obj``, under the deadline (mpi4py's own
        ``allgather`` of objects blocks without one)."""
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.empty(self.size, dtype=np.int64)
        self._wait(self.comm.Iallgather(np.array([payload.size], np.int64), sizes))
        gathered = np.empty(int(sizes.sum()), dtype=np.uint8)
        self._wait(self.comm.Iallgatherv(payload, [gathered, (sizes.tolist(),
                                                              _starts(sizes.tolist()))]))
        bounds = list(accumulate(sizes.tolist(), initial=0))
        return [pickle.loads(gathered[a:b].tobytes()) for a, b in zip(bounds, bounds[1:])]

    def bcast_object(self, obj: Any, root: int) -> Any:
        """Root's picklable ``obj`` on every rank, under the deadline."""
        payload = pickle.dumps(obj) if self.rank == root else b""
        length = np.array([len(payload)], dtype=np.int64)
        self._wait(self.comm.Ibcast(length, root=root))
        buffer = np.frombuffer(payload, np.uint8).copy() if self.rank == root \
            else np.empty(int(length[0]), np.uint8)
        self._wait(self.comm.Ibcast(buffer, root=root))
        return pickle.loads(buffer.tobytes())
