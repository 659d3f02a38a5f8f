"""tools/bench/transformers.py at toy sizes: both sides run and report a
time, the peak memory and the operators that dominate."""

import re
import subprocess
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy size
pytestmark = pytest.mark.full

requires.module("transformers")
TOY = ["--seq", "64", "--hidden", "32", "--heads", "2", "--layers", "1", "--repeats", "1"]


def test_ring_on_two_ranks_reports_time_memory_and_operators():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.transformers", *TOY],
                 timeout=300)
    assert result.returncode == 0, result.stdout
    assert re.search(r"commlib_ring, 2 ranks .* s per step, peak RSS per rank \d+, \d+ MiB",
                     result.stdout), result.stdout
    assert "top operators" in result.stdout


def test_sdpa_alone_reports_time_memory_and_operators():
    result = subprocess.run([sys.executable, "-m", "commlib.tools.bench.transformers", "--alone",
                             *TOY], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"sdpa, one process, 1 threads, seq 64: \S+ s per step, peak RSS \d+ MiB",
                     result.stdout), result.stdout
