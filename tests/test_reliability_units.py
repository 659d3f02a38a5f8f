"""The pieces of the reliability layer that need no peers."""

import math

import numpy as np
import pytest

import commlib
from commlib import consistency, memory, watchdog


@pytest.mark.parametrize("raw, seconds", [("", watchdog.DEFAULT_TIMEOUT_S), ("2.5", 2.5),
                                          ("0", math.inf)])
def test_timeout_from_env(monkeypatch, raw, seconds):
    monkeypatch.setenv("COMMLIB_TIMEOUT", raw)
    assert watchdog.timeout_from_env() == seconds


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_bad_timeout(monkeypatch, raw):
    monkeypatch.setenv("COMMLIB_TIMEOUT", raw)
    with pytest.raises(ValueError, match="COMMLIB_TIMEOUT"):
        watchdog.timeout_from_env()


@pytest.mark.parametrize("raw, on", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_check_from_env(monkeypatch, raw, on):
    monkeypatch.setenv("COMMLIB_CHECK", raw)
    assert consistency.check_from_env() is on


def test_bad_check(monkeypatch):
    monkeypatch.setenv("COMMLIB_CHECK", "maybe")
    with pytest.raises(ValueError, match="COMMLIB_CHECK"):
        consistency.check_from_env()


def test_signature_is_stable_and_sensitive():
    a = consistency.signature("allreduce", ("float32", (4,)), (("heads", 8),))
    assert a == consistency.signature("allreduce", ("float32", (4,)), (("heads", 8),))
    assert a != consistency.signature("allreduce", ("float32", (4,)), (("heads", 16),))
    assert a >= 0


def test_wait_until_times_out_and_breaks_the_communicator():
    comm = commlib.init(timeout=0.2)
    dog = comm._watchdog
    try:
        with pytest.raises(commlib.CommTimeoutError, match="timed out after 0.2s"):
            dog.begin("test")
            dog.wait_until(lambda: False)
        with pytest.raises(commlib.CommlibError, match="can no longer be used"):
            comm.barrier()
    finally:
        comm.free()


def test_shortfall(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda on_device, framework: 10 * 2**30)
    assert memory.shortfall(2**20, on_device=False) is None  # small: not even looked at
    assert memory.shortfall(9 * 2**30, on_device=False) is None
    message = memory.shortfall(11 * 2**30, on_device=False)
    assert "11,811,160,064 bytes" in message and "host memory" in message


def test_the_gpu_counts_the_owners_allocator_cache(monkeypatch):
    """torch's caching allocator holds memory the driver calls used: free to
    torch, not to CuPy; JAX's preallocation is not free to commlib's CuPy
    buffers, and the refusal says how to leave room."""
    monkeypatch.setattr(memory, "_device_free", lambda: 1 * 2**30)
    monkeypatch.setattr(memory, "_cache_free",
                        lambda framework: 6 * 2**30 if framework == "torch" else 0)
    assert memory.shortfall(4 * 2**30, on_device=True, framework="torch") is None
    assert "GPU memory" in memory.shortfall(4 * 2**30, on_device=True, framework="cupy")
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in \
        memory.shortfall(4 * 2**30, on_device=True, framework="jax")


def test_host_memory_is_known_here():
    available = memory.available_bytes(on_device=False)
    assert available is None or available > 0


def test_one_rank_refusal(monkeypatch):
    monkeypatch.setattr(memory, "CHECK_FROM_BYTES", 0)
    monkeypatch.setattr(memory, "available_bytes", lambda on_device, framework: 8)
    comm = commlib.init()
    try:
        with pytest.raises(commlib.AllocationRefusedError, match="rows from each rank: \\[2\\]"):
            comm.alltoallv(np.ones((2, 2)), [2])
    finally:
        comm.free()


def test_a_setup_wait_gives_up_and_keeps_its_request():
    """init's first waits have no communicator to send notices on: each
    rank gives up at its own deadline, keeping what MPI may still complete."""
    class NeverDone:
        def Test(self):
            return False

    request, created = NeverDone(), object()
    with pytest.raises(commlib.CommTimeoutError, match=r"init \(test\) timed out after 0.1s"):
        watchdog.wait_alone(request, 0.1, "init (test)", created)
    assert any(request in held and created in kept for kept, held, _ in watchdog._retired)
