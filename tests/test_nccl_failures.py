"""The NCCL backend's failure paths, with NCCL, CuPy and the stream stood in
for (so they run without a GPU): every way out of a wait aborts the NCCL
communicator exactly once, a launch that fails tells the peers and aborts,
and an aborted communicator is not destroyed a second time."""

import pytest

import commlib
from commlib.backends.nccl import NcclBackend


class _Calls:
    def __init__(self):
        self.aborts = self.destroys = self.group_ends = 0


class _FakeComm:
    def __init__(self, calls, fail_send=False):
        self.calls, self.fail_send = calls, fail_send

    def send(self, *args):
        if self.fail_send:
            raise RuntimeError("NCCL error: invalid usage")

    def recv(self, *args):
        pass

    def abort(self):
        self.calls.aborts += 1

    def destroy(self):
        self.calls.destroys += 1


class _FakeNccl:
    def __init__(self, calls):
        self.calls = calls

    def groupStart(self):
        pass

    def groupEnd(self):
        self.calls.group_ends += 1


class _FakeStream:
    ptr, done = 0, False  # a kernel that never finishes: a peer that never comes

    def wait_event(self, event):
        pass

    def record(self):
        return None


class _InterruptedStream(_FakeStream):
    @property
    def done(self):
        raise KeyboardInterrupt  # Ctrl-C while the host polls the stream


class _FakeCupy:
    class cuda:
        @staticmethod
        def get_current_stream():
            return _FakeStream()


def _backend(comm, fail_send=False):
    calls = _Calls()
    backend = NcclBackend.__new__(NcclBackend)  # no GPU: the parts __init__ would build
    backend.comm, backend._nccl, backend._cupy = _FakeComm(calls, fail_send), _FakeNccl(calls), \
        _FakeCupy
    backend.stream, backend.watchdog, backend._aborted = _FakeStream(), comm._watchdog, False
    backend.rank, backend.size = 0, 1
    return backend, calls


def test_a_timeout_aborts_nccl_once_and_free_does_not_destroy_it_again():
    comm = commlib.init(timeout=0.1)
    try:
        backend, calls = _backend(comm)
        with pytest.raises(commlib.CommTimeoutError):
            backend._grouped([(0, 8, 0)], [(0, 8, 0)])
        backend._abort()
        backend.free()
        assert (calls.aborts, calls.destroys, calls.group_ends) == (1, 0, 1)
    finally:
        comm.free()


def test_an_interrupted_wait_aborts_nccl():
    comm = commlib.init(timeout=60)
    try:
        backend, calls = _backend(comm)
        backend.stream = _InterruptedStream()
        with pytest.raises(KeyboardInterrupt):
            backend._grouped([(0, 8, 0)], [(0, 8, 0)])
        assert calls.aborts == 1
    finally:
        comm.free()


def test_a_failed_launch_closes_the_group_tells_the_peers_and_aborts():
    comm = commlib.init(timeout=60)
    try:
        backend, calls = _backend(comm, fail_send=True)
        with pytest.raises(RuntimeError, match="invalid usage"):
            backend._grouped([(0, 8, 0)], [(0, 8, 0)])
        assert (calls.aborts, calls.group_ends) == (1, 1)
        assert "NCCL launch failed: NCCL error: invalid usage" in comm._watchdog.failure
        with pytest.raises(commlib.CommlibError, match="can no longer be used"):
            comm.barrier()
    finally:
        comm.free()
