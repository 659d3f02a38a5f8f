"""Faults under mpiexec, each with a hard limit: the job must end, with
errors that name the rank at fault, well inside the limit."""

import subprocess
import sys
import time

import pytest

from launch import TESTS, run

HARD_LIMIT_S = 60


def launch(script, nprocs=3, **env):
    start = time.monotonic()
    try:
        result = run(nprocs, [sys.executable, str(TESTS / "faults" / script)],
                     timeout=HARD_LIMIT_S, env={k: str(v) for k, v in env.items()})
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{script} hung past {HARD_LIMIT_S}s:\n{expired.output}")
    return result, time.monotonic() - start


def test_straggler_times_out_and_is_named():
    result, elapsed = launch("straggler.py", COMMLIB_TIMEOUT=3)
    out = result.stdout
    assert result.returncode != 0, out
    assert elapsed < 30, f"took {elapsed:.1f}s\n{out}"
    assert "rank 0: CommTimeoutError" in out or "rank 2: CommTimeoutError" in out, out
    assert "Not heard from: rank(s) 1" in out, out


@pytest.mark.parametrize("script", ["uncaught.py", "uncaught_forwarder_behind.py"])
def test_uncaught_exception_aborts_the_job(script):
    result, elapsed = launch(script, COMMLIB_TIMEOUT=300)
    out = result.stdout
    assert result.returncode != 0, out
    assert elapsed < 30, f"took {elapsed:.1f}s\n{out}"
    # the report is the whole diagnosis: it must survive the abort
    assert "uncaught RuntimeError on rank 1 of 3" in out, repr(out)
    assert "deliberate failure on rank 1" in out, repr(out)


def test_killed_rank_ends_the_job():
    result, elapsed = launch("kill9.py", COMMLIB_TIMEOUT=5)
    assert result.returncode != 0, result.stdout
    assert elapsed < 45, f"took {elapsed:.1f}s\n{result.stdout}"


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_shape_mismatch_raises_on_every_rank(nprocs):
    result, _ = launch("shape_mismatch.py", nprocs=nprocs, COMMLIB_TIMEOUT=30)
    out = result.stdout
    assert result.returncode == 0, out
    for rank in range(nprocs):
        assert f"rank {rank}: CollectiveMismatchError" in out, out
    assert "rank 1: allreduce, float64, (5,), sum" in out, out


def test_calls_in_different_order_are_caught_under_check():
    result, _ = launch("order_mismatch.py", nprocs=3, COMMLIB_TIMEOUT=30)
    out = result.stdout
    assert result.returncode == 0, out
    for rank in range(3):
        assert f"rank {rank}: CollectiveMismatchError" in out, out
    assert "rank 0: allreduce, float64, (2,), sum" in out and "rank 2: barrier" in out, out
