"""The Communicator: commlib's collective layer.

It validates arguments, allocates results, and hands C-contiguous arrays to
a backend: the MPI backend for host arrays, the device backend (NCCL) for
CUDA arrays, or MPI staged through host memory for CUDA arrays where there is
no NCCL (``backends.staged``). Inputs arrive through DLPack
(``commlib.dlpack``) and results go back in the caller's framework. Inputs
are never written to.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from . import consistency, graph_names, memory
from . import counts as _counts
from .backends import REDUCE_OPS, Backend
from .backends.mpi import MpiBackend
from .backends.nccl import NcclBackend
from .backends.staged import StagedBackend
from .dlpack import Native, byte_view, callers_stream, contiguous, unwrap, writable
from .errors import AllocationRefusedError, CollectiveMismatchError
from .in_flight import Pending, PreparedAlltoall
from .namespace import contiguous as framework_contiguous
from .namespace import namespace
from .topology import Topology

# alltoallv's count exchange sends each peer [rows, signature], or this
_REJECTED = consistency.REJECTED
_C_INT_LIMIT = 2**31


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what}={axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def _split_problem(color: Any, key: Any, backend: Any,
                   parent_backend: str) -> Optional[ValueError]:
    """What is wrong with split's arguments, if anything: MPI takes C ints,
    and a child can keep its parent's device transport or go without one,
    not gain one."""
    for name, value, low, wanted in (
            ("color", color, 0, "a non-negative integer below 2**31"),
            ("key", key, -_C_INT_LIMIT, "an integer in [-2**31, 2**31)")):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                or not low <= value < _C_INT_LIMIT:
            return ValueError(f"split: {name} must be {wanted}, got {value!r}")
    if backend is not None and not (isinstance(backend, str)
                                    and backend in ("mpi", parent_backend)):
        hint = (" (a split cannot add NCCL: create the parent with commlib.init(backend='nccl'))"
                if backend == "nccl" else "")
        return ValueError(f"split: backend must be None (keep this communicator's, "
                          f"{parent_backend!r}) or 'mpi' (CUDA arrays over MPI, no NCCL "
                          f"communicator), got {backend!r}{hint}")
    return None


def _concat_blocks(stacked, axis: int):
    """[P, *block] -> the P blocks concatenated along ``axis``: one copy, in
    the array's own framework."""
    xp = namespace(stacked)
    blocks, block_shape = stacked.shape[0], stacked.shape[1:]
    shape = list(block_shape)
    shape[axis] *= blocks
    return xp.reshape(xp.moveaxis(stacked, 0, axis), tuple(shape))


def _in_framework(x: Any, native: Native) -> Any:
    """``x`` itself when it is a NumPy, CuPy, torch or JAX array, else (a
    list, another DLPack exporter) its NumPy/CuPy view: the array that
    layout changes run on, in its own framework."""
    try:
        namespace(x)
        return x
    except TypeError:
        return native.data


def _row_facts(dtype: np.dtype, row_shape: Tuple[int, ...],
               on_device: bool) -> Tuple[str, str, str]:
    return (f"dtype {dtype.name}", f"row shape {row_shape}",
            "CUDA arrays" if on_device else "host arrays")


@functools.lru_cache(maxsize=256)
def _row_signature(dtype: np.dtype, row_shape: Tuple[int, ...], on_device: bool,
                   context: consistency.Context) -> int:
    """alltoallv's fingerprint: element type, the shape of one row, host or
    CUDA (they travel differently), and the registered parameters. Cached:
    it is computed on every call."""
    return consistency.signature("alltoallv", _row_facts(dtype, row_shape, on_device), context)


def _on_callers_stream(method: Callable) -> Callable:
    """The collective on the caller's CUDA stream, for torch CUDA input
    (``arrays.callers_stream``): one place every collective passes through."""
    @functools.wraps(method)
    def run(self, x, *args, **kwargs):
        with callers_stream(x):
            return method(self, x, *args, **kwargs)
    return run


class Communicator:
    """A group of ranks and the collectives they run together.

    Create one with ``commlib.init()``; ``split`` makes sub-communicators,
    which belong to it and are freed with it.
    ``backend`` names the transport for CUDA arrays: "nccl", or "mpi" when
    they are staged through host memory over MPI; host arrays always travel
    over MPI. Every call has a deadline (``COMMLIB_TIMEOUT``); with
    ``COMMLIB_CHECK=1`` every call first checks that all ranks agree on its
    arguments.
    """

    def __init__(self, host: MpiBackend, topology: Topology,
                 device: Optional[Backend] = None, check: bool = False):
        self._host = host
        self._device = device
        self._staged: Optional[StagedBackend] = None  # made at the first CUDA array without NCCL
        self._watchdog = host.watchdog
        self._check = check
        self._context: consistency.Context = ()
        self.topology = topology
        self._children: List[Communicator] = []  # made by split, freed with this one
        self._cached: Dict[Hashable, Tuple[int, int, str, Communicator]] = {}  # split's cache_key
        # what a compiled graph's ops name this communicator by (commlib.graph_names)
        self.handle = graph_names.name("comm", self)

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def size(self) -> int:
        return self._host.size

    @property
    def backend(self) -> str:
        return self._device.name if self._device is not None else self._host.name

    @property
    def mpi_comm(self):
        """The communicator's own MPI communicator (a duplicate, not the user's)."""
        return self._host.comm

    @property
    def timeout(self) -> float:
        """Seconds any call may wait for its peers (``COMMLIB_TIMEOUT``)."""
        return self._watchdog.timeout

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, backend={self.backend!r}, "
                f"nodes={self.topology.num_nodes})")

    @contextlib.contextmanager
    def fingerprint(self, **params: Any) -> Iterator[None]:
        """Make every collective inside the block check that all ranks pass
        the same ``params`` too (always in alltoallv, elsewhere under
        ``COMMLIB_CHECK=1``). For algorithms: one line, e.g.
        ``with comm.fingerprint(op="ring_attention", heads=h, layout=layout):``.
        """
        outer = self._context
        self._context = outer + tuple(sorted(params.items()))
        try:
            yield
        finally:
            self._context = outer

    # -- plumbing ---------------------------------------------------------
    def _begin(self, op: str, *facts: Any) -> None:
        """Every collective starts here: the watchdog counts the call (and
        refuses if this communicator already failed), then, under
        COMMLIB_CHECK, all ranks compare fingerprints. ``facts`` are passed
        as they are (dtypes, shapes) and put into words only when checked:
        a small call cannot afford formatting it does not use."""
        self._watchdog.begin(op)
        if self._check:
            consistency.agree(self._host, op, facts, self._context)

    def agree(self, op: str, *facts: Any, problem: Optional[Exception] = None,
              carry: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """Check now, whatever ``COMMLIB_CHECK`` says, that every rank calls
        ``op`` with the same ``facts`` (and registered parameters) and that
        no rank had a ``problem`` with its own input; otherwise raise
        ``CollectiveMismatchError`` on every rank. For algorithms, before a
        long computation whose collectives would otherwise hang or mismatch.
        ``carry``: int64 rows [size, n] (n alike everywhere), row i to rank
        i in the same exchange; returns the [size, n] rows received."""
        self._watchdog.begin(op)
        return consistency.agree(self._host, op, facts, self._context, problem, carry)

    def _backend_for(self, *natives: Native) -> Backend:
        """The transport for these arrays; they must all live on one side
        (and, under NCCL, on its GPU). Found wrong on this rank only, so the
        peers, which may already be transferring, are told: they raise at
        their next wait instead of at their deadline."""
        if len(natives) == 1 and not natives[0].on_device:
            return self._host  # the common case, without the checks' overhead
        try:
            on_device = natives[0].on_device
            if any(n.on_device != on_device for n in natives[1:]):
                raise ValueError("host and CUDA arrays were mixed in one call; commlib does "
                                 "not copy between them silently: move them to one device "
                                 "first")
            if on_device and self._device is not None:
                self._check_devices(natives)
        except ValueError as error:
            self._watchdog.give_up(str(error))
            raise
        return self._transport(on_device)

    def _check_devices(self, natives: Sequence[Native]) -> None:
        """NCCL reads only the GPU it was built on: every CUDA array of a
        call must live there."""
        mine = self._device.device_index
        for position, native in enumerate(natives):
            theirs = native.data.device.id
            if theirs != mine:
                which = f"array {position} of this call" if len(natives) > 1 else "the array"
                raise ValueError(f"{which} is on CUDA device {theirs}, but this communicator "
                                 f"drives device {mine}; move it there (.to('cuda:{mine}')) "
                                 f"or create the communicator with commlib.init(device=...)")

    def _transport(self, on_device: bool) -> Backend:
        """MPI for host arrays; for CUDA arrays NCCL, or, on a communicator
        without it, MPI staged through host memory."""
        if not on_device:
            return self._host
        if self._device is not None:
            return self._device
        if self._staged is None:
            self._staged = StagedBackend(self._host)
        return self._staged

    def split(self, color: int, key: int = 0, *, cache_key: Optional[Hashable] = None,
              backend: Optional[str] = None) -> "Communicator":
        """Ranks with the same ``color`` (a non-negative integer) form a new
        communicator, ordered by ``key`` then by rank; nodes of the topology
        are kept. Collective, under the deadline: the ranks first confirm
        that all of them arrived with the same ``backend`` and valid
        arguments (``consistency.rendezvous``; a bad ``color``, ``key`` or
        ``backend`` on any rank raises ``CollectiveMismatchError`` on every
        rank), and only then enter MPI's split, which has no deadline of its
        own.

        ``backend`` (in ``commlib.init``'s words): None or this one's name
        keeps this communicator's transport for CUDA arrays; "mpi" makes a
        child without a device transport (CUDA arrays travel over MPI, as on
        any communicator without NCCL), for one that only checks and agrees:
        under NCCL each split otherwise builds its own NCCL communicator and
        stream.

        The new communicator belongs to this one: this one's ``free()``
        frees it too, unless it was freed before. ``cache_key`` (any
        hashable, e.g. ``("hybrid.ring", 4)``) keeps it under that key:
        later calls with the key return it without communicating, until it
        is freed. For algorithms that need the same sub-communicators at
        every call; all ranks use the same keys, each with one color, key
        and backend."""
        child_backend = self.backend if backend is None else backend
        if cache_key is not None and cache_key in self._cached:
            cached_color, cached_key, cached_backend, child = self._cached[cache_key]
            if child._watchdog.freed is None:
                if (cached_color, cached_key, cached_backend) != (color, key, child_backend):
                    raise ValueError(f"cache_key {cache_key!r} holds the split of color "
                                     f"{cached_color}, key {cached_key} and backend "
                                     f"{cached_backend!r}, not of color {color!r}, key "
                                     f"{key!r} and backend {child_backend!r}: give each "
                                     f"split its own cache_key")
                return child
        problem = _split_problem(color, key, backend, self.backend)
        self._watchdog.begin("split")
        facts = (f"backend={child_backend!r}",) + \
            (() if cache_key is None else (f"cache_key={cache_key!r}",))
        rows = consistency.rendezvous(
            self._host, "split", (0, 0) if problem else (int(color), int(key)),
            facts, self._context, problem)
        colors, keys = rows[:, 0].tolist(), rows[:, 1].tolist()
        members = sorted((r for r in range(self.size) if colors[r] == color),
                         key=lambda r: (keys[r], r))  # MPI's order in the new communicator
        host = MpiBackend(self._host.comm.Split(int(color), int(key)), self.timeout)
        topology = self.topology.restrict(members, host.rank)
        device = self._device.split(host) \
            if self._device is not None and child_backend != "mpi" else None
        child = Communicator(host, topology, device, self._check)
        self._children = [c for c in self._children if c._watchdog.freed is None] + [child]
        if cache_key is not None:
            self._cached[cache_key] = (color, key, child_backend, child)
        return child

    def free(self) -> None:
        """Release the underlying communicators, this one's children
        (``split``) first (collective). Later calls raise ``CommlibError``;
        a second ``free()`` does nothing. Where a call failed, MPI's are
        kept, unfreed: late messages of that call must never reach a later
        communicator (``Watchdog.close``)."""
        self._free("by free()")

    def _free(self, how: str) -> None:
        if self._watchdog.freed is not None:
            return
        for child in self._children:
            child._free("with its parent")
        self._children, self._cached = [], {}
        if self._device is not None:
            self._device.free()
        self._host.free()
        self._watchdog.freed = how

    # -- collectives --------------------------------------------------------
    @_on_callers_stream
    def alltoallv(self, x: Any, send_counts: Any,
                  recv_counts: Any = None) -> Tuple[Any, np.ndarray]:
        """Variable-size all-to-all of rows along axis 0.

        ``send_counts[i]`` consecutive rows of ``x`` go to rank i. The result
        holds rank 0's rows first, then rank 1's, and so on; ``recv_counts``
        (host int64) says how many came from each. When ``recv_counts`` is not
        given (or under COMMLIB_CHECK) the counts are exchanged, and that
        exchange also checks that all ranks agree on dtype and row shape and
        accepted their inputs: a problem on any rank raises
        ``CollectiveMismatchError`` on every rank.
        """
        wait, native, out, recv, _ = self._post_alltoallv(x, send_counts, recv_counts)
        wait()
        return native.wrap(out), recv

    @_on_callers_stream
    def alltoallv_async(self, x: Any, send_counts: Any,
                        recv_counts: Any = None) -> "Pending":
        """Start ``alltoallv`` and return once the payload is posted;
        ``.wait()`` gives the rows, ``.recv_counts`` the counts (known at
        once). A count exchange, when there is one, happens before this
        returns. Over MPI a progress thread (``commlib.progress``) moves
        the payload while the caller computes; ``x`` must not change until
        the wait."""
        wait, native, out, recv, sending = self._post_alltoallv(x, send_counts, recv_counts)
        return Pending("alltoallv", wait, native, out, sending, self._abandon,
                       progress=self._transport(native.on_device) is not self._device,
                       recv_counts=recv)

    def _post_alltoallv(self, x: Any, send_counts: Any, recv_counts: Any) -> tuple:
        """Checks, count exchange, allocation, and the payload posted:
        (wait, native, out, recv counts, the buffer being sent). Lean: at
        small sizes every microsecond of Python shows."""
        self._watchdog.begin("alltoallv")
        native = unwrap(x)
        backend = self._backend_for(native)
        problem = None
        try:
            if native.data.ndim == 0:
                raise ValueError("alltoallv needs an array with rows along axis 0, got a scalar")
            send = _counts.as_counts("send_counts", send_counts, self.size)
            _counts.check_rows("send_counts", send, native.data.shape[0])
            recv = None if recv_counts is None else \
                _counts.as_counts("recv_counts", recv_counts, self.size)
        except ValueError as error:
            problem = error
        if recv_counts is None or self._check:
            exchanged = self._exchange_counts(native, send if problem is None else None, problem)
            if recv_counts is None:
                recv = exchanged
            else:
                self._verify_recv_counts(recv, exchanged)
        elif problem is not None:
            raise problem
        data = contiguous(native)
        row_shape = data.shape[1:]
        row_bytes = data.itemsize * math.prod(row_shape)
        rows = sum(recv.tolist())  # Python sums: a NumPy reduction costs more at P entries
        if rows * row_bytes >= memory.CHECK_FROM_BYTES:
            self._refuse_unless_it_fits(rows * row_bytes, native, recv)
        out = native.empty((rows,) + row_shape)
        wait = backend.start_alltoallv(data, [n * row_bytes for n in send.tolist()], out,
                                       [n * row_bytes for n in recv.tolist()])
        return wait, native, out, recv, data

    def _exchange_counts(self, native: Native, send: Optional[np.ndarray],
                         problem: Optional[Exception]) -> np.ndarray:
        """Tell every peer how many rows it gets and what a row is (or that
        this rank rejected its input); raise on every rank if any rank is
        unhappy. One small all-to-all, the one the counts need anyway."""
        if problem is None:
            header = np.empty((self.size, 2), dtype=np.int64)
            header[:, 0] = send
            header[:, 1] = _row_signature(native.dtype, native.data.shape[1:], native.on_device,
                                          self._context)
        else:
            header = np.full((self.size, 2), _REJECTED, dtype=np.int64)
        received = self._host.exchange_int64(header)
        # all signatures equal this rank's: a byte comparison, cheaper than a ufunc
        if problem is None and received[:, 1].tobytes() == header[:, 1].tobytes():
            return received[:, 0].copy()
        signatures = received[:, 1]
        rejected = np.flatnonzero(signatures == _REJECTED)
        if rejected.size:
            consistency.raise_disagreement(
                self._host, signatures, str(problem),
                "alltoallv was rejected by rank(s) " + ", ".join(map(str, rejected)), rejected)
        consistency.raise_disagreement(
            self._host, signatures,
            consistency.describe("alltoallv", _row_facts(native.dtype, native.data.shape[1:],
                                                         native.on_device), self._context),
            "alltoallv ranks disagree on what a row is (all must send the same dtype and "
            "trailing shape from the same side, host or CUDA, and register the same "
            "parameters)")

    def _verify_recv_counts(self, given: np.ndarray, exchanged: np.ndarray) -> None:
        """COMMLIB_CHECK: the recv_counts a rank passed must be what its peers
        send. One 8-byte allreduce says whether any rank is wrong; only then
        are the reports gathered."""
        wrong = not np.array_equal(given, exchanged)
        anyone = np.empty(1, np.int64)
        self._host.allreduce(np.array([wrong], np.int64), anyone, np.dtype(np.int64), "max")
        if not anyone[0]:
            return
        reports = self._host.allgather_object(
            f"recv_counts {given.tolist()} but the peers send {exchanged.tolist()}"
            if wrong else None)
        culprits = [r for r, report in enumerate(reports) if report is not None]
        if culprits:
            lines = "\n  ".join(f"rank {r}: {reports[r]}" for r in culprits)
            raise CollectiveMismatchError(f"alltoallv: recv_counts do not match what the "
                                          f"peers send (COMMLIB_CHECK=1):\n  {lines}")

    def _refuse_unless_it_fits(self, nbytes: int, native: Native, recv: np.ndarray) -> None:
        """Refuse, before allocating, a receive the memory cannot hold; the
        peers hear of it through the watchdog."""
        why = memory.shortfall(nbytes, native.on_device, native.framework)
        if why is None:
            return
        message = (f"alltoallv on rank {self.rank}: {why} (rows from each rank: "
                   f"{recv.tolist()}); send fewer rows to this rank or cap them "
                   f"with a capacity factor")
        self._watchdog.give_up(message)
        raise AllocationRefusedError(message)

    @_on_callers_stream
    def alltoall(self, x: Any, split_axis: int = 0, concat_axis: int = 0,
                 out: Any = None) -> Any:
        """Split ``x`` along ``split_axis`` into ``size`` equal chunks, send
        chunk i to rank i, and concatenate what arrives, in rank order, along
        ``concat_axis``. The layout changes run in x's own framework.
        ``out`` (with both axes 0): a NumPy or CuPy array of x's shape and
        dtype that receives the result, for callers that own the memory
        (the JAX binding passes XLA's output buffer)."""
        native = unwrap(x)
        data, size = native.data, self.size
        self._begin("alltoall", native.dtype, data.shape, split_axis, concat_axis)
        backend = self._backend_for(native)
        if out is not None:
            if (split_axis, concat_axis) != (0, 0) or data.ndim == 0 or data.shape[0] % size:
                raise ValueError(f"alltoall writes into out= only with split_axis=0 and "
                                 f"concat_axis=0 and axis 0 a multiple of {size}; got shape "
                                 f"{tuple(data.shape)}, axes {split_axis}, {concat_axis}")
            backend.alltoall(contiguous(native), self._target(out, native))
            return out
        split_axis = _normalize_axis(split_axis, data.ndim, "split_axis")
        concat_axis = _normalize_axis(concat_axis, data.ndim, "concat_axis")
        length = data.shape[split_axis]
        if length % size:
            raise ValueError(f"alltoall splits axis {split_axis} (length {length}) into {size} "
                             f"equal chunks; make that axis a multiple of {size}")
        if split_axis == concat_axis == 0:  # rank-major already: no layout change
            received = native.empty(data.shape)
            backend.alltoall(contiguous(native), received)
            return native.wrap(received)
        array = _in_framework(x, native)
        xp = namespace(array)
        send = unwrap(framework_contiguous(xp.moveaxis(array, split_axis, 0)))
        received = send.empty(send.data.shape)
        backend.alltoall(send.data, received)
        chunk_first = xp.reshape(send.wrap(received),
                                 (size, length // size) + tuple(send.data.shape[1:]))
        return _concat_blocks(xp.moveaxis(chunk_first, 1, split_axis + 1), concat_axis)

    def prepare_alltoall(self, x: Any, out: Any) -> "PreparedAlltoall":
        """``alltoall(x, out=out)`` set up once to run many times on the same
        two arrays (C-contiguous, of one shape and dtype, axis 0 a multiple
        of the size): ``start()`` begins one and returns its wait, with
        none of a call's per-array work (the arrays are resolved here). Over
        MPI it is MPI 4's persistent ``Alltoall_init`` (a start costs about
        half a new ``Ialltoall``); each transport prepares its own
        (``Backend.prepare_alltoall``). For callers that keep their buffers
        between calls: a decode step's MoE exchange (issue 46)."""
        native = unwrap(x)
        target = self._target(out, native)
        if not native.data.flags.c_contiguous or native.data.ndim == 0 \
                or native.data.shape[0] % self.size:
            raise ValueError(f"prepare_alltoall takes a C-contiguous array whose axis 0 is a "
                             f"multiple of {self.size}; got shape {tuple(native.data.shape)}")
        backend = self._backend_for(native, unwrap(out))
        return PreparedAlltoall(backend.prepare_alltoall(native.data, target), native,
                                begin=self._begin, abandon=self._abandon)

    @_on_callers_stream
    def alltoall_many(self, arrays: Sequence[Any]) -> List[Any]:
        """Several all-to-alls in one exchange: each array is cut along axis 0
        into ``size`` equal chunks, chunk i to rank i, and every peer gets one
        message holding its chunk of every array (worth it while messages are
        latency-bound). Returns each array's [size * chunk, ...] result, rank
        0's chunk first, in that array's framework. The packing copies bytes
        only; arrays may differ in dtype and trailing shape."""
        natives, backend, packed, unpack = self._pack_many(arrays, "alltoall_many")
        out = natives[0].empty(packed.shape, np.uint8)
        backend.alltoall(packed, out)
        return unpack(out)

    @_on_callers_stream
    def alltoall_many_async(self, arrays: Sequence[Any], out: Any = None) -> "Pending":
        """Start ``alltoall_many(arrays)`` and return once it is posted;
        ``.wait()`` gives the list of results. Computation in between
        overlaps the transfer (over MPI, where a progress thread runs:
        ``commlib.progress``); the arrays must not change until the wait.
        ``out`` (one array only): a C-contiguous array of its shape and
        dtype that receives the result, for a caller that keeps its buffers
        between calls (on the CPU a fresh large buffer costs its page
        faults at every call)."""
        natives, backend, packed, unpack = self._pack_many(arrays, "alltoall_many_async")
        if out is None:
            out = natives[0].empty(packed.shape, np.uint8)
        elif len(natives) != 1:
            raise ValueError(f"alltoall_many_async takes out= with one array, got "
                             f"{len(natives)}")
        else:
            out = byte_view(self._target(out, natives[0])).reshape(packed.shape)
        chunk = [packed.shape[1]] * self.size
        wait = backend.start_alltoallv(packed, chunk, out, chunk)
        return Pending("alltoall_many", wait, natives[0], out, packed, self._abandon,
                       progress=self._transport(natives[0].on_device) is not self._device,
                       unpack=unpack)

    def _pack_many(self, arrays: Sequence[Any], op: str) -> tuple:
        """alltoall_many's checks and packing: (natives, backend, the packed
        bytes [size, per peer], and how received bytes become the results)."""
        natives = [unwrap(x) for x in arrays]
        size = self.size
        self._begin(op, *((n.dtype, n.data.shape) for n in natives))
        backend = self._backend_for(*natives)
        for n in natives:
            if n.data.ndim == 0 or n.data.shape[0] % size:
                raise ValueError(f"{op} cuts axis 0 into {size} equal chunks; got an "
                                 f"array of shape {tuple(n.data.shape)}")
        parts = [byte_view(contiguous(n)).reshape(size, -1) for n in natives]
        if len(parts) == 1:
            packed = parts[0]
        else:
            # from the owner's allocator (torch's, for torch: a capture may not cudaMalloc)
            packed = natives[0].empty((size, sum(part.shape[1] for part in parts)), np.uint8)
            offset = 0
            for part in parts:
                packed[:, offset:offset + part.shape[1]] = part
                offset += part.shape[1]
        if isinstance(backend, NcclBackend):  # the captured packing copies read them
            backend.hold_if_captured(*parts)

        def unpack(out) -> List[Any]:
            if len(natives) == 1:  # the received bytes are the result: no copy
                n = natives[0]
                return [n.wrap(out.view(n.data.dtype).reshape(n.data.shape))]
            results, offset = [], 0
            for n, part in zip(natives, parts):
                width = part.shape[1]
                result = n.empty(n.data.shape)
                byte_view(result).reshape(size, width)[...] = out[:, offset:offset + width]
                results.append(n.wrap(result))
                offset += width
            return results
        return natives, backend, packed, unpack

    def ring_shift(self, x: Any, shift: int = 1) -> Any:
        """Every rank sends ``x`` ``shift`` places up the ring: the result is
        ``x`` of rank ``(rank - shift) % size``. All ranks pass the same shape."""
        return self.ring_shift_async(x, shift).wait()

    @_on_callers_stream
    def ring_shift_async(self, x: Any, shift: int = 1, lane: int = 0,
                         out: Any = None) -> "Pending":
        """Start ``ring_shift(x, shift)`` and return at once; ``.wait()`` gives
        the result. For overlapping a transfer with computation (RingExchange);
        ``x`` must not change until then. Shifts on different ``lane``s
        overlap each other: under NCCL, lane n > 0 has its own communicator
        and stream, made (by every rank together) on its first use. ``out``:
        an array of x's shape and dtype that receives the result (as for
        ``alltoall``)."""
        native = unwrap(x)
        self._begin("ring_shift", native.dtype, native.data.shape, shift, lane)
        if isinstance(lane, bool) or not isinstance(lane, int) or lane < 0:
            raise ValueError(f"lane must be a non-negative integer, got {lane!r}")
        backend = self._backend_for(native)
        if lane and isinstance(backend, NcclBackend):
            backend = backend.lane(lane)
        data = contiguous(native)
        target = native.empty(data.shape) if out is None else self._target(out, native)
        shift = int(shift) % self.size
        if shift == 0:
            target[...] = data
            if isinstance(backend, NcclBackend):  # a captured copy reads it
                backend.hold_if_captured(data)
            return Pending("ring_shift", lambda: None, native, target, data, abandon=None)
        wait = backend.start_sendrecv(data, (self.rank + shift) % self.size, target,
                                      (self.rank - shift) % self.size)
        return Pending("ring_shift", wait, native, target, data, abandon=self._abandon)

    def _target(self, out: Any, like: Native):
        """The caller's ``out`` as a buffer to receive into: x's shape, dtype
        and side, C-contiguous, writable."""
        target = unwrap(out)
        if (target.dtype, tuple(target.data.shape), target.on_device) != \
                (like.dtype, tuple(like.data.shape), like.on_device) \
                or not target.data.flags.c_contiguous or not writable(target.data):
            raise ValueError(f"out must be a writable C-contiguous array of x's shape "
                             f"{tuple(like.data.shape)} and dtype {like.dtype.name}, got "
                             f"{tuple(target.data.shape)} {target.dtype.name}")
        return target.data

    def _abandon(self, op: str, *in_flight: Any) -> None:
        """A transfer was dropped before its ``wait()`` (an exception between
        the two, or a forgotten handle): its receive may still match a
        peer's message, now or in a later call. Keep its buffers for as long
        as the communicator, and give up on it, telling the peers: the next
        call raises instead of hanging."""
        self._watchdog.hold(*in_flight)
        self._watchdog.give_up(f"an asynchronous {op} was dropped before its wait() (an "
                               f"exception in between, or a handle never waited on); its "
                               f"transfer may still be in flight")

    @_on_callers_stream
    def allgather(self, x: Any, axis: int = 0) -> Any:
        """Every rank's ``x`` (same shape everywhere), concatenated along
        ``axis`` in rank order."""
        native = unwrap(x)
        self._begin("allgather", native.dtype, native.data.shape, axis)
        backend = self._backend_for(native)
        data = contiguous(native)
        axis = _normalize_axis(axis, max(data.ndim, 1), "axis")
        if data.ndim == 0:
            data = data.reshape(1)
        out = native.empty((self.size,) + data.shape)
        backend.allgather(data, out)
        return _concat_blocks(native.wrap(out), axis)

    @_on_callers_stream
    def allreduce(self, x: Any, op: str = "sum") -> Any:
        """Element-wise reduction over ranks: "sum", "prod", "max" or "min".
        For bool, "sum" is logical or and "prod" logical and."""
        native = unwrap(x)
        self._begin("allreduce", native.dtype, native.data.shape, op)
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduction op {op!r}; use one of {', '.join(REDUCE_OPS)}")
        backend = self._backend_for(native)
        data = contiguous(native)
        out = native.empty(data.shape)
        backend.allreduce(data, out, native.dtype, op)
        return native.wrap(out)

    @_on_callers_stream
    def bcast(self, x: Any, root: int = 0) -> Any:
        """Root's ``x`` on every rank. Elsewhere ``x`` may be None (the result
        is then a NumPy array, or CuPy when root's is on the GPU) or an array
        of root's shape and dtype whose framework the result takes."""
        self._begin("bcast", root)
        if not 0 <= root < self.size:
            raise ValueError(f"root={root} is not a rank of this communicator (size {self.size})")
        native = unwrap(x) if x is not None else None
        header = None
        if self.rank == root:
            header = "the root passed None instead of an array" if native is None else \
                (native.dtype, native.data.dtype, tuple(native.data.shape), native.on_device)
        header = self._host.bcast_object(header, root)
        if isinstance(header, str):
            raise CollectiveMismatchError(f"bcast from root {root}: {header}")
        dtype, storage, shape, on_device = header
        if self.rank == root:
            data = contiguous(native)
            self._backend_for(native).bcast(data, root)
            result = native.empty(data.shape)
            result[...] = data
            return native.wrap(result)
        mine = native is not None and native.on_device == on_device
        out = native.empty(shape, storage) if mine else self._xp(on_device).empty(shape, storage)
        self._transport(on_device).bcast(out, root)
        if native is None:
            return out
        if (native.dtype, tuple(native.data.shape), native.on_device) != (dtype, shape, on_device):
            raise CollectiveMismatchError(
                f"bcast: rank {self.rank} passed an array of {native.dtype.name} "
                f"{tuple(native.data.shape)} but root {root} broadcast {dtype.name} {shape} "
                f"({'CUDA' if on_device else 'host'}); pass None or a matching array")
        return native.wrap(out)

    @staticmethod
    def _xp(on_device: bool):
        if on_device:
            import cupy
            return cupy
        return np

    def barrier(self) -> None:
        self._begin("barrier")
        self._host.barrier()
