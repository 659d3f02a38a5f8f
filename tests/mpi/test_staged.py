"""CUDA buffers over MPI (backends.staged), on both paths: staged through
host memory in chunks, and CUDA-aware (device buffers straight to MPI).

NumPy arrays stand in for device buffers, so that the whole pipeline runs
anywhere. The lazy stand-in device queues every copy like a CUDA stream and
runs one per poll, and its "pinned" memory comes poisoned: a chunk sent
before its download ran, or a result returned before its upload ran, shows
up as wrong bytes. Every result is compared with the host backend's
(MpiBackend) on the same data. The ``gpu`` tests run the real CuPy path
where a device exists."""

import contextlib
import time
from collections import deque

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.backends import cuda_aware
from commlib.backends.staged import CHUNK_BYTES, CupyDevice, HostCopies, PinnedPool, StagedBackend

from arrayimpl import cuda_skip_reason
from conftest import all_ranks, raises_everywhere

# the staged pipeline between peers, odd included
WORLD_SIZES = (2, 3)

POISON = 0xEE
CHUNK = 8  # bytes: small blocks already make several chunks


def _address(a) -> int:
    return a.__array_interface__["data"][0]


class LazyDevice:
    """A NumPy "GPU": copies are queued in order and run one per poll of
    ``done``, as on a CUDA stream; pinned buffers start poisoned. ``log``
    records each copy as it runs: (kind, source address, target address,
    bytes)."""

    def __init__(self, log=None):
        self.queue, self.log = deque(), [] if log is None else log
        self.pool = PinnedPool(lambda nbytes: np.full(nbytes, POISON, np.uint8))

    @staticmethod
    def bytes_of(buf):
        return buf.reshape(-1).view(np.uint8)

    def follow_caller(self):
        self.log.append(("follow",))

    def sync_caller(self):
        self.log.append(("sync",))

    def _queue(self, kind, src, dst):
        token = object()
        self.queue.append((token, kind, src, dst))
        return token

    def download(self, src, dst):
        return self._queue("down", src, dst)

    def upload(self, src, dst):
        return self._queue("up", src, dst)

    def copy(self, src, dst):
        return self._queue("copy", src, dst)

    def done(self, token):
        if self.queue:
            _, kind, src, dst = self.queue.popleft()
            dst[...] = src
            self.log.append((kind, _address(src), _address(dst), src.nbytes))
        return all(token is not queued[0] for queued in self.queue)


class LoggedHost:
    """The host backend, with each chunk message logged into ``log``."""

    def __init__(self, host, log):
        self._host, self.log = host, log

    def __getattr__(self, name):
        return getattr(self._host, name)

    def isend(self, buf, peer):
        self.log.append(("send", peer, _address(buf), buf.nbytes))
        return self._host.isend(buf, peer)

    def irecv(self, buf, peer):
        self.log.append(("recv", peer, _address(buf), buf.nbytes))
        return self._host.irecv(buf, peer)


PATHS = ["staged", "cuda-aware", "staged-sync"]


def _backend(comm, path, chunk=CHUNK, log=None):
    if path == "staged-sync":
        return StagedBackend(comm._host, device=HostCopies(), cuda_aware=False, chunk_bytes=chunk)
    return StagedBackend(comm._host, device=LazyDevice(log), cuda_aware=path == "cuda-aware",
                         chunk_bytes=chunk)


def _sizes(pattern, size):
    """Bytes from rank i to rank j, the same matrix on every rank."""
    rng = np.random.default_rng(size)
    return {
        "zeros": np.zeros((size, size), np.int64),
        "uniform": np.full((size, size), 3 * CHUNK, np.int64),
        "ragged": rng.integers(0, 5 * CHUNK, (size, size)),
        "sparse": rng.integers(0, 3 * CHUNK, (size, size)) * (rng.random((size, size)) < 0.4),
        "next-only": np.roll(np.eye(size, dtype=np.int64), 1, axis=1) * (7 * CHUNK + 3),
        "self-only": np.eye(size, dtype=np.int64) * (2 * CHUNK + 1),
        "one-byte": np.ones((size, size), np.int64),
    }[pattern]


def _send_buffer(comm, sizes):
    n = int(sizes[comm.rank].sum())
    return ((np.arange(n) * 7 + 31 * comm.rank) % 251).astype(np.uint8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pattern", ["zeros", "uniform", "ragged", "sparse", "next-only",
                                     "self-only", "one-byte"])
def test_alltoallv_equals_the_host_backend(comm, path, pattern):
    sizes = _sizes(pattern, comm.size)
    send_bytes, recv_bytes = sizes[comm.rank], sizes[:, comm.rank].copy()
    send = _send_buffer(comm, sizes)
    out = np.full(int(recv_bytes.sum()), 1, np.uint8)
    want = np.empty_like(out)
    _backend(comm, path).alltoallv(send, send_bytes, out, recv_bytes)
    comm._host.alltoallv(send, send_bytes, want, recv_bytes)
    assert all_ranks(np.array_equal(out, want))


@pytest.mark.parametrize("path", PATHS)
def test_alltoall_of_floats_and_default_chunks(comm, path):
    send = np.arange(comm.size * 1000, dtype=np.float32) + 1000 * comm.rank
    want = np.empty_like(send)
    comm._host.alltoall(send, want)
    outs = []
    for chunk in (CHUNK, 4096, CHUNK_BYTES):
        out = np.zeros_like(send)
        _backend(comm, path, chunk).alltoall(send, out)
        outs.append(out)
    assert all_ranks(all(np.array_equal(out, want) for out in outs))


@pytest.mark.parametrize("path", PATHS)
def test_a_prepared_alltoall_runs_again_on_rewritten_input(comm, path):
    """``prepare_alltoall`` (the Backend protocol's persistent exchange):
    each start sends what the send buffer holds then, as the host does."""
    send = np.zeros(comm.size * 300, np.float32)
    out, want = np.zeros_like(send), np.empty_like(send)
    prepared = _backend(comm, path).prepare_alltoall(send, out)
    results = []
    for run in range(2):
        send[...] = np.arange(send.size) + 1000 * comm.rank + 7 * run
        prepared.start()()
        comm._host.alltoall(send, want)
        results.append(np.array_equal(out, want))
    assert all_ranks(all(results))


def test_chunks_go_in_order_and_overlap_the_copies(comm):
    """Staged: each chunk is sent after its download ran, a peer's chunks
    in order; the first send leaves before the last download runs."""
    log = []
    backend = _backend(comm, "staged", log=log)
    backend.host = LoggedHost(comm._host, log)
    per_peer = 5 * CHUNK
    send = _send_buffer(comm, np.full((comm.size, comm.size), per_peer))
    out = np.empty_like(send)
    sizes = np.full(comm.size, per_peer, np.int64)
    backend.alltoallv(send, sizes, out, sizes)
    want = _reference(comm, send, sizes)
    base = _address(send)
    downloaded = {}  # pinned address -> offset in send, as the downloads ran
    order_ok, sent = True, {}
    for position, entry in enumerate(log):
        if entry[0] == "down":
            downloaded[entry[2]] = (entry[1] - base, position)
        elif entry[0] == "send":
            _, peer, address, nbytes = entry
            offset, when = downloaded.get(address, (None, None))
            order_ok &= offset is not None and when < position and nbytes <= CHUNK
            sent.setdefault(peer, []).append(offset)
    peers = [p for p in range(comm.size) if p != comm.rank]
    in_order = all(sent.get(p) == list(range(p * per_peer, (p + 1) * per_peer, CHUNK))
                   for p in peers)
    downs = [i for i, entry in enumerate(log) if entry[0] == "down"]
    sends = [i for i, entry in enumerate(log) if entry[0] == "send"]
    overlap = comm.size == 1 or sends[0] < downs[-1]
    follows = comm.size == 1 or log.index(("follow",)) < downs[0]
    assert all_ranks(order_ok and in_order and overlap and follows
                     and np.array_equal(out, want)), (order_ok, in_order, overlap, follows, sent)


def _reference(comm, send, sizes):
    want = np.empty_like(send)
    comm._host.alltoallv(send, sizes, want, sizes)
    return want


@pytest.mark.parametrize("path", PATHS)
def test_shifts_started_back_to_back_match_in_order(comm, path):
    """Ring attention starts K's and V's shifts, then waits (in any order):
    every chunk must still land in its own call."""
    backend = _backend(comm, path)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    k = np.full(5 * CHUNK + 3, comm.rank, np.uint8)
    v = np.full(4 * CHUNK, 100 + comm.rank, np.uint8)
    k_out, v_out = np.zeros_like(k), np.zeros_like(v)
    wait_k = backend.start_sendrecv(k, right, k_out, left)
    wait_v = backend.start_sendrecv(v, right, v_out, left)
    wait_v()
    wait_k()
    assert all_ranks((k_out == left).all() and (v_out == 100 + left).all())


@pytest.mark.parametrize("path", PATHS)
def test_allgather_bcast_and_allreduce(comm, path):
    backend = _backend(comm, path)
    part = ((np.arange(3 * CHUNK + 5) + comm.rank * 13) % 256).astype(np.uint8)
    gathered, want = np.zeros((comm.size, part.size), np.uint8), np.empty((comm.size, part.size),
                                                                          np.uint8)
    backend.allgather(part, gathered)
    comm._host.allgather(part, want)
    root = comm.size - 1
    buf = np.full(2 * CHUNK + 1, comm.rank + 7, np.int16)
    root_before = buf.copy()
    backend.bcast(buf, root)
    total = np.empty(4, np.int64)
    backend.allreduce(np.arange(4, dtype=np.int64) * comm.rank, total, np.dtype(np.int64), "sum")
    flags = np.empty(2, np.bool_)
    backend.allreduce(np.array([comm.rank == 0, True]), flags, np.dtype(np.bool_), "prod")
    assert all_ranks(np.array_equal(gathered, want) and (buf == root + 7).all()
                     and (comm.rank != root or np.array_equal(buf, root_before))
                     and np.array_equal(total, np.arange(4) * sum(range(comm.size)))
                     and flags.tolist() == [comm.size == 1, True])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("logical", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn])
def test_low_precision_allreduce_reduces_values(comm, path, logical):
    """bfloat16 and float8 arrive as integer storage (torch/JAX CUDA arrays):
    reduced by value, on the host, on both paths."""
    values = np.full(3, 1.5, dtype=logical)
    storage = values.view(np.uint16 if values.itemsize == 2 else np.uint8)
    reduced = np.empty_like(storage)
    _backend(comm, path).allreduce(storage, reduced, np.dtype(logical), "sum")
    got = reduced.view(logical).astype(np.float32)
    want = np.array(1.5 * comm.size, np.float32).astype(logical).astype(np.float32)
    assert all_ranks((got == want).all())


def test_download_and_upload_functions_still_drive_it(comm):
    """StagedBackend(host, download, upload), as before the device objects."""
    moves = {"down": 0, "up": 0}

    def download(buf):
        moves["down"] += 1
        return np.array(buf, copy=True)

    def upload(host, buf):
        moves["up"] += 1
        np.copyto(buf, host)
    backend = StagedBackend(comm._host, download, upload, cuda_aware=False)
    send = np.arange(comm.size * 3, dtype=np.float32) + 100 * comm.rank
    out, want = np.empty_like(send), np.empty_like(send)
    backend.alltoall(send, out)
    comm._host.alltoall(send, want)
    peers = comm.size - 1  # one block to each peer, each in one chunk
    assert all_ranks(np.array_equal(out, want) and moves == {"down": peers, "up": peers})


def test_pinned_pool_is_reused_and_only_grows(comm):
    backend = _backend(comm, "staged-sync")
    pool = backend._device.pool
    sizes = np.full(comm.size, 1000, np.int64)
    send = np.ones(comm.size * 1000, np.uint8)
    out = np.empty_like(send)
    backend.alltoallv(send, sizes, out, sizes)
    held = pool.held_bytes
    for _ in range(3):
        backend.alltoallv(send, sizes, out, sizes)
    small = PinnedPool(lambda n: np.empty(n, np.uint8))
    a = small.take(10)
    small.give(a)
    b = small.take(5)
    c = small.take(3 << 20)
    assert all_ranks(pool.held_bytes == held and b is a and c.nbytes == 4 << 20
                     and small.held_bytes == (1 << 20) + (4 << 20))


def test_the_path_is_named():
    forced = StagedBackend(None, device=HostCopies(), cuda_aware=True)
    detected = StagedBackend(None, device=HostCopies())
    support = cuda_aware.detect()
    assert forced.path == "cuda-aware" and "cuda-aware" in repr(forced)
    assert detected.path == ("cuda-aware" if support.aware else "staged")
    assert detected.reason == support.reason and detected.name == "mpi"


# -- faults: never a hang --------------------------------------------------------

@contextlib.contextmanager
def _failing_communicator(timeout):
    c = commlib.init(timeout=timeout)
    MPI.COMM_WORLD.Barrier()  # every rank is out of init before anyone fails
    try:
        yield c
    finally:
        c.free()  # kept, not freed, by MPI (Watchdog.close): it failed


class StuckDevice(LazyDevice):
    """A device whose copies never finish."""

    def done(self, token):
        return False


@pytest.mark.parametrize("path", ["staged", "cuda-aware"])
def test_a_copy_that_never_finishes_times_out(path):
    with _failing_communicator(timeout=1) as c:
        backend = StagedBackend(c._host, device=StuckDevice(), cuda_aware=path == "cuda-aware")
        x = np.ones(c.size * 4, np.uint8)
        # the first rank to time out tells the others, which may hear of it first
        raises_everywhere(commlib.CommlibError,
                          lambda: backend.alltoall(x, np.empty_like(x)), match="timed out")


def test_a_copy_that_fails_on_the_gpu_is_raised_on_every_rank_at_once():
    """The last rank's first download reports cudaErrorIllegalAddress (read
    as CupyDevice reads its events: tests/test_staged_status.py): it raises
    CommlibError naming the error and its peers PeerFailedError saying so,
    well before the deadline (the old reading took it for "not yet")."""
    from test_staged_status import ILLEGAL_ADDRESS, ILLEGAL_TEXT, NOT_READY, _Device

    with _failing_communicator(timeout=60) as c:
        failing = c.rank == c.size - 1
        device = _Device([NOT_READY, ILLEGAL_ADDRESS]) if failing else HostCopies()
        backend = StagedBackend(c._host, device=device, cuda_aware=False, chunk_bytes=CHUNK)
        x = np.ones(c.size * 4 * CHUNK, np.uint8)
        start = time.monotonic()
        error = raises_everywhere(commlib.CommlibError,
                                  lambda: backend.alltoall(x, np.empty_like(x)),
                                  match=ILLEGAL_TEXT)
        assert all_ranks(time.monotonic() - start < 30)
        assert all_ranks(isinstance(error, commlib.PeerFailedError) != failing
                         and not isinstance(error, commlib.CommTimeoutError)), error


@pytest.mark.parametrize("path", PATHS)
def test_a_peer_that_gives_up_is_heard_while_waiting(path):
    """Rank 0 gives up instead of sending; its peers wait in a staged
    alltoallv for its chunks and raise PeerFailedError well before the
    deadline."""
    if MPI.COMM_WORLD.Get_size() == 1:
        pytest.skip("needs a peer")
    error = None
    with _failing_communicator(timeout=60) as c:
        if c.rank == 0:
            c._watchdog.give_up("deliberate failure for the test")
        else:
            backend = _backend(c, path)
            recv = np.zeros(c.size, np.int64)
            recv[0] = 10 * CHUNK
            try:
                backend.alltoallv(np.empty(0, np.uint8), np.zeros(c.size, np.int64),
                                  np.empty(10 * CHUNK, np.uint8), recv)
            except commlib.CommlibError as caught:
                error = caught
        assert all_ranks(c.rank == 0 or (isinstance(error, commlib.PeerFailedError)
                                         and "deliberate" in str(error))), error


# -- the real thing: CuPy on a GPU ----------------------------------------------
_NO_CUPY = cuda_skip_reason("cupy")
needs_cupy = pytest.mark.skipif(_NO_CUPY is not None, reason=str(_NO_CUPY))
_AWARE = cuda_aware.detect()
CUDA_PATHS = [pytest.param(False, id="staged"),
              pytest.param(True, id="cuda-aware", marks=pytest.mark.skipif(
                  not _AWARE.aware, reason=f"MPI is not CUDA-aware here: {_AWARE.reason}"))]


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("aware", CUDA_PATHS)
@pytest.mark.parametrize("chunk", [1000, CHUNK_BYTES])
@pytest.mark.parametrize("pattern", ["zeros", "ragged", "next-only", "self-only"])
def test_cupy_alltoallv_equals_the_host_backend(comm, aware, chunk, pattern):
    import cupy
    sizes = _sizes(pattern, comm.size) * 997  # blocks of many 1000-byte chunks, and a tail
    send = _send_buffer(comm, sizes)
    recv_bytes = sizes[:, comm.rank].copy()
    out = cupy.zeros(int(recv_bytes.sum()), cupy.uint8)
    backend = StagedBackend(comm._host, cuda_aware=aware, chunk_bytes=chunk)
    backend.alltoallv(cupy.asarray(send), sizes[comm.rank], out, recv_bytes)
    want = np.empty(int(recv_bytes.sum()), np.uint8)
    comm._host.alltoallv(send, sizes[comm.rank], want, recv_bytes)
    assert all_ranks(np.array_equal(out.get(), want))


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("aware", CUDA_PATHS)
def test_cupy_inputs_made_on_the_callers_stream(comm, aware):
    """Inputs computed on a non-default stream, results read on it: the
    copies wait for that stream, and the results are complete on return."""
    import cupy
    backend = StagedBackend(comm._host, cuda_aware=aware, chunk_bytes=1 << 20)
    n = 3 << 20
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    with cupy.cuda.Stream(non_blocking=True):
        x = (cupy.arange(n, dtype=cupy.float32) * 0 + comm.rank).cumsum() / (1 + comm.rank)
        shifted = cupy.empty_like(x)
        backend.start_sendrecv(x, right, shifted, left)()
        gathered = cupy.empty((comm.size, n), cupy.float32)
        backend.allgather(x, gathered)
        total = cupy.empty_like(x)
        backend.allreduce(x, total, np.dtype(np.float32), "sum")
        checks = (shifted.get(), gathered.get(), total.get())
    expect = [(np.arange(1, n + 1, dtype=np.float32) * r / (1 + r)) for r in range(comm.size)]
    assert all_ranks(np.allclose(checks[0], expect[left])
                     and all(np.allclose(checks[1][r], expect[r]) for r in range(comm.size))
                     and np.allclose(checks[2], sum(expect), rtol=1e-5))


@pytest.mark.gpu
@needs_cupy
def test_cupy_arrays_on_an_mpi_communicator():
    """A communicator without NCCL moves CuPy arrays through this backend,
    each collective equal to the same call on NumPy arrays."""
    import cupy
    c = commlib.init(backend="mpi")
    try:
        rows = np.arange(c.size * 5 * 64, dtype=np.float32).reshape(-1, 64) + c.rank
        counts = [(r + c.rank) % 3 + 1 for r in range(c.size)]
        x = rows[:sum(counts)]
        results = [
            (c.alltoallv(cupy.asarray(x), counts)[0], c.alltoallv(x, counts)[0]),
            (c.ring_shift(cupy.asarray(rows)), c.ring_shift(rows)),
            (c.allgather(cupy.asarray(rows)), c.allgather(rows)),
            (c.allreduce(cupy.asarray(rows)), c.allreduce(rows)),
            (c.bcast(cupy.asarray(rows), root=0), c.bcast(rows, root=0)),
            (c.alltoall(cupy.asarray(rows)), c.alltoall(rows)),
        ]
        assert all_ranks(all(isinstance(got, cupy.ndarray) and np.array_equal(got.get(), want)
                             for got, want in results))
    finally:
        c.free()


@pytest.mark.gpu
@needs_cupy
def test_cupy_pinned_pool_is_reused(comm):
    import cupy
    backend = StagedBackend(comm._host, cuda_aware=False)
    x = cupy.ones(comm.size << 20, cupy.uint8)
    out = cupy.empty_like(x)
    backend.alltoall(x, out)
    held = CupyDevice.of(x).pool.held_bytes
    for _ in range(3):  # a backend per call, as the Communicator makes them: one pool
        StagedBackend(comm._host, cuda_aware=False).alltoall(x, out)
    assert all_ranks(CupyDevice.of(x).pool.held_bytes == held and bool((out == 1).all()))
