"""Fixtures for tests that run on every rank of an mpiexec launch.

Each test makes the same collective calls on every rank in the same order,
and decides pass/fail together (``all_ranks``), so that one rank's failure
does not leave the others waiting in the next test's collective.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from mpi4py import MPI

import commlib

# rank 0 searches (hypothesis_ranks.given_on_every_rank), the others follow its draws;
# derandomized, so a failure found in CI is found again here
settings.register_profile("mpi", derandomize=True, database=None, deadline=None,
                          suppress_health_check=list(HealthCheck), max_examples=40)
settings.load_profile("mpi")


# at this world size the JAX cases but the hybrid's are left out
# (deselected, counted in pytest's summary): JAX compiles every program anew
# per world size, which made it three quarters of a launch's time, and its
# traced exchanges are the same Communicator calls the NumPy and torch cases
# make here. They run at 2 and 3 ranks (an odd size among them); the
# hybrid's 2 x 2 grid exists only here, so its JAX cases stay, as do those
# of a test marked ``jax_at_4`` (two emulated hosts asked of it). JAX on a
# GPU is kept.
JAX_LEFT_OUT_AT = 4


def pytest_collection_modifyitems(config, items):
    if MPI.COMM_WORLD.Get_size() != JAX_LEFT_OUT_AT:
        return
    kept, left_out = [], []
    for item in items:
        (left_out if _left_out(item) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def _left_out(item) -> bool:
    """A case parametrized with JAX on the host (a value "jax", a case dict
    or tuple holding it, or a backend whose framework is JAX, not on a
    GPU), and neither with the hybrid nor marked ``jax_at_4``."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.get_closest_marker("jax_at_4") is not None:
        return False
    values = list(_leaves(callspec.params.values()))
    host_jax = any(v == "jax" or (getattr(v, "framework", None) == "jax"
                                  and not getattr(v, "gpu", True)) for v in values)
    return host_jax and not any(isinstance(v, str) and "hybrid" in v for v in values)


def _leaves(values):
    for value in values:
        if isinstance(value, dict):
            yield from _leaves(value.values())
        elif isinstance(value, (tuple, list)):
            yield from _leaves(value)
        else:
            yield value


@pytest.fixture(scope="session")
def comm():
    c = commlib.init()
    yield c
    c.free()


@pytest.fixture(scope="session", autouse=True)
def transport_reported(comm, record_testsuite_property):
    """The transport this launch chose for CUDA arrays goes in the junit
    report (tools/gpu_check.sh prints it per step), and where
    COMMLIB_EXPECT_BACKEND names one, any other fails every test: on one
    GPU a fallback from NCCL to the staged MPI path is otherwise silent."""
    record_testsuite_property("commlib_backend", comm.backend)
    expected = os.environ.get("COMMLIB_EXPECT_BACKEND")
    if expected and comm.backend != expected:
        pytest.fail(f"commlib.init() chose backend {comm.backend!r}, but "
                    f"COMMLIB_EXPECT_BACKEND={expected}")


def all_ranks(ok: bool) -> bool:
    """True on every rank when ``ok`` is true on every rank."""
    return bool(MPI.COMM_WORLD.allreduce(bool(ok), op=MPI.LAND))


def same_on_all_ranks(value) -> None:
    """Fail (everywhere) unless every rank drew the same ``value``."""
    values = MPI.COMM_WORLD.allgather(repr(value))
    assert len(set(values)) == 1, f"ranks drew different examples: {values}"


def raises_everywhere(exc_type, call, match=None):
    """``call()`` raises ``exc_type`` on this rank, and every rank agrees.
    Every rank enters first: a rank that gives up on purpose must not do so
    while a slower peer is still in the calls before (its ``commlib.init``,
    say), where that peer would hear of it outside this check (seen across
    hosts, where the other host's ranks start later)."""
    MPI.COMM_WORLD.Barrier()
    try:
        call()
    except exc_type as error:
        caught = error
    else:
        caught = None
    assert all_ranks(caught is not None), f"{exc_type.__name__} not raised on every rank"
    if match is not None:
        assert match in str(caught), str(caught)
    return caught


def reference_alltoallv(x: np.ndarray, send_counts: np.ndarray) -> np.ndarray:
    """What alltoallv must return, computed with mpi4py's own Alltoallv."""
    world = MPI.COMM_WORLD
    recv_counts = np.empty_like(send_counts)
    world.Alltoall(send_counts, recv_counts)
    row = x.itemsize * int(np.prod(x.shape[1:]))
    out = np.empty((int(recv_counts.sum()),) + x.shape[1:], dtype=x.dtype)
    sdispl = np.concatenate([[0], np.cumsum(send_counts)[:-1]]) * row
    rdispl = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]) * row
    world.Alltoallv([np.ascontiguousarray(x).view(np.uint8).reshape(-1),
                     (send_counts * row, sdispl), MPI.BYTE],
                    [out.view(np.uint8).reshape(-1), (recv_counts * row, rdispl), MPI.BYTE])
    return out
