"""Runs tests/mpi/ under mpiexec at world sizes 1 to 4, and checks what every
rank ran (tests/rank_outcomes.py): a launch that exits 0 having skipped
what it should have run, or having run nothing, fails too."""

import subprocess
import sys

import pytest

import rank_outcomes
from launch import TESTS, hosts_for, run

# a hang detector (COMMLIB_TIMEOUT=120 ends a stuck collective sooner): the
# whole suite at 4 ranks, oversubscribing a 2-core machine, took 560 s once;
# its framework half on 2 emulated hosts (TCP between them) 661 s
TIMEOUT_S = 1200
MPI_TESTS = TESTS / "mpi"
# the files whose tests are about the MPI library underneath: collectives,
# communicators and their lifecycle (splits, duplicates, frees, deadlines),
# point-to-point rings and stages. .ci/run reruns them under Open MPI; the
# rest (attention and MoE in each framework, transformers) sit above the
# same calls and show nothing more about another MPI.
MPI_LAYER = ("test_alltoallv.py", "test_collectives.py", "test_device_choice.py",
             "test_fuzz.py", "test_gpu_faults.py", "test_moe.py", "test_reliability.py",
             "test_ring.py", "test_staged.py", "test_topology.py", "test_ulysses.py")
# COMMLIB_CHECK=1 adds a fingerprint agreement before every collective: what
# it can catch or break is in the collectives and agreement themselves, and
# in the algorithms whose ranks pass different shapes legitimately (uneven
# lengths and heads, packed documents, routed counts) or check on the
# hybrid's sub-communicators, which a check must not refuse. The framework
# variants repeat the same collectives.
CHECKED = ("test_alltoallv.py", "test_collectives.py", "test_fuzz.py", "test_moe.py",
           "test_packed.py", "test_reliability.py", "test_ring.py", "test_ulysses.py",
           "test_ulysses_uneven.py")


def _files(names=None, exclude=()):
    """tests/mpi's test files (those in ``names`` only, if given), less
    ``exclude``, sorted."""
    found = {path.name for path in MPI_TESTS.glob("test_*.py")}
    return sorted((found if names is None else found & set(names)) - set(exclude))


def _launch(nprocs, files, check, name):
    """A launch of ``files`` at ``nprocs`` ranks, across ``COMMLIB_TEST_HOSTS``
    emulated hosts where they divide it (CI: the 4-rank launches on 2 hosts x 2)."""
    hosts = hosts_for(nprocs)
    return pytest.param(nprocs, hosts, files, check,
                        id=name + (f"-on-{hosts}-hosts" if hosts > 1 else ""))


# inference and masks at 4 ranks in a launch of their own: the frameworks
# launch alone takes 661 s of its 1200 s on 2 emulated hosts
SERVING = ("test_generate.py", "test_inference.py", "test_masks.py", "test_moe_replicated.py")
LAUNCHES = [_launch(1, _files(), "0", "1"),
            _launch(2, _files(), "0", "2"),
            _launch(3, _files(), "0", "3"),
            _launch(4, _files(MPI_LAYER), "0", "4-mpi-layer"),
            _launch(4, _files(exclude=MPI_LAYER + SERVING), "0", "4-frameworks"),
            _launch(4, _files(SERVING), "0", "4-inference-and-masks"),
            _launch(3, _files(CHECKED), "1", "3-checked")]


@pytest.mark.parametrize("nprocs, hosts, files, check", LAUNCHES)
def test_mpi_suite(nprocs, hosts, files, check, tmp_path, request):
    """tests/mpi at each world size (4 ranks in two launches, so that a second
    MPI can rerun the MPI layer alone); some of it once more with
    COMMLIB_CHECK=1."""
    argv = [sys.executable, str(TESTS / "mpi_pytest.py"), str(tmp_path),
            *(str(MPI_TESTS / name) for name in files)]
    env = {"COMMLIB_CHECK": check, "COMMLIB_TIMEOUT": "120"}
    try:
        result = run(nprocs, argv, timeout=TIMEOUT_S, env=env, hosts=hosts)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tests/mpi at {nprocs} ranks did not finish in {TIMEOUT_S}s (a hang):\n"
                    + _logs(tmp_path, nprocs))
    ranks = rank_outcomes.read_launch(tmp_path, nprocs)
    request.config.stash.setdefault(rank_outcomes.SUMMARY_KEY, []).append(
        rank_outcomes.summary(request.node.name, ranks))
    assert result.returncode == 0, (f"tests/mpi failed at {nprocs} ranks "
                                    f"(exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                                    + _logs(tmp_path, nprocs))
    problems = rank_outcomes.problems(ranks)
    assert not problems, (
        f"tests/mpi at {nprocs} ranks passed, but not everything it should have ran "
        f"({len(problems)} problems). Install what is missing (pip install -e "
        "'.[test,torch,jax,transformers]'); a skip this world size or machine cannot avoid "
        "goes on rank_outcomes.ALLOWED_SKIPS:\n" + "\n".join(problems[:40]))


def test_the_named_selections_are_files_of_tests_mpi():
    """A misspelt or renamed file would drop out of its launch unseen."""
    missing = sorted(set(MPI_LAYER + CHECKED) - set(_files()))
    assert not missing, f"named in test_multirank.py but not in tests/mpi: {missing}"


def test_every_launch_shares_one_jax_compilation_cache():
    """Two launches see the same cache directory, which exists, with every
    program kept however quick to compile."""
    show = ("import os; print(os.environ['JAX_COMPILATION_CACHE_DIR'], "
            "os.path.isdir(os.environ['JAX_COMPILATION_CACHE_DIR']), "
            "os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'])")
    seen = {run(1, [sys.executable, "-c", show], timeout=120).stdout.strip() for _ in range(2)}
    assert len(seen) == 1 and seen.pop().endswith(" True 0"), seen


def _logs(logdir, nprocs):
    parts = []
    for rank in range(nprocs):
        log = logdir / f"rank{rank}.log"
        text = log.read_text() if log.exists() else "(no log)"
        parts.append(f"----- rank {rank} -----\n{text[-6000:]}")
    return "\n".join(parts)
