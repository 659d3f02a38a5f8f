"""CUDA buffers over MPI, staged through host memory (backends.staged), with
NumPy arrays standing in for device buffers so that it runs anywhere: every
operation equals the host backend's and moves each buffer across exactly
once each way; bfloat16 held as integer storage is reduced by value."""

import ml_dtypes
import numpy as np
import pytest

from commlib.backends.staged import StagedBackend

from conftest import all_ranks


class _Counted:
    """download/upload stand-ins that count what crosses."""

    def __init__(self):
        self.down = self.up = 0

    def download(self, buf):
        self.down += 1
        return np.array(buf, copy=True)

    def upload(self, host, buf):
        self.up += 1
        np.copyto(buf, host)


@pytest.fixture
def staged(comm):
    moves = _Counted()
    return StagedBackend(comm._host, moves.download, moves.upload), moves


def _bytes(n, comm):
    return np.full(comm.size, n, dtype=np.int64)


def test_alltoall_and_alltoallv(comm, staged):
    backend, moves = staged
    send = (np.arange(comm.size * 3, dtype=np.float32) + 100 * comm.rank)
    out, want = np.empty_like(send), np.empty_like(send)
    backend.alltoallv(send, _bytes(12, comm), out, _bytes(12, comm))
    comm._host.alltoallv(send, _bytes(12, comm), want, _bytes(12, comm))
    again = np.empty_like(send)
    backend.alltoall(send, again)
    assert all_ranks(np.array_equal(out, want) and np.array_equal(again, want)
                     and (moves.down, moves.up) == (2, 2))


def test_sendrecv_uploads_only_when_waited(comm, staged):
    backend, moves = staged
    send = np.full(4, comm.rank, dtype=np.int64)
    out = np.empty_like(send)
    wait = backend.start_sendrecv(send, (comm.rank + 1) % comm.size, out,
                                  (comm.rank - 1) % comm.size)
    before = moves.up
    wait()
    assert all_ranks(before == 0 and moves.up == 1
                     and (out == (comm.rank - 1) % comm.size).all())


def test_allgather_bcast_and_bfloat16_allreduce(comm, staged):
    backend, _ = staged
    gathered = np.empty((comm.size, 2), dtype=np.int32)
    backend.allgather(np.full(2, comm.rank, dtype=np.int32), gathered)
    buf = np.full(3, comm.rank + 7, dtype=np.int16)
    backend.bcast(buf, 0)
    values = np.full(3, 1.5, dtype=ml_dtypes.bfloat16)
    storage = values.view(np.uint16)  # how a torch/JAX bfloat16 CUDA array arrives
    reduced = np.empty_like(storage)
    backend.allreduce(storage, reduced, np.dtype(ml_dtypes.bfloat16), "sum")
    assert all_ranks(np.array_equal(gathered[:, 0], np.arange(comm.size))
                     and (buf == 7).all()
                     and (reduced.view(ml_dtypes.bfloat16).astype(np.float32)
                          == 1.5 * comm.size).all())
