"""Runs tests/mpi/ under mpiexec at world sizes 1 to 4, each in one launch."""

import subprocess
import sys

import pytest

from launch import TESTS, run

# a hang detector (COMMLIB_TIMEOUT=120 ends a stuck collective sooner): the
# whole suite at 4 ranks, oversubscribing a 2-core machine, took 560 s once
TIMEOUT_S = 900


@pytest.mark.parametrize("nprocs, check", [(1, "0"), (2, "0"), (3, "0"), (4, "0"), (3, "1")],
                         ids=["1", "2", "3", "4", "3-checked"])
def test_mpi_suite(nprocs, check, tmp_path):
    """The whole suite at each world size; once more with COMMLIB_CHECK=1,
    where every collective also compares fingerprints."""
    argv = [sys.executable, str(TESTS / "mpi_pytest.py"), str(tmp_path), str(TESTS / "mpi")]
    env = {"COMMLIB_CHECK": check, "COMMLIB_TIMEOUT": "120"}
    try:
        result = run(nprocs, argv, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tests/mpi at {nprocs} ranks did not finish in {TIMEOUT_S}s (a hang):\n"
                    + _logs(tmp_path, nprocs))
    assert result.returncode == 0, (f"tests/mpi failed at {nprocs} ranks "
                                    f"(exit {result.returncode}):\n{result.stdout[-3000:]}\n"
                                    + _logs(tmp_path, nprocs))


def _logs(logdir, nprocs):
    parts = []
    for rank in range(nprocs):
        log = logdir / f"rank{rank}.log"
        text = log.read_text() if log.exists() else "(no log)"
        parts.append(f"----- rank {rank} -----\n{text[-6000:]}")
    return "\n".join(parts)
