"""tools/bench/moe.py frameworks at toy sizes, on two ranks: one line per
framework's MoE path and the bare exchanges, each with its ratio (issue
37: a change measured in one framework only had slowed another)."""

import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy sizes
pytestmark = pytest.mark.full

requires.module("torch")
requires.module("jax")


def test_bench_moe_frameworks_reports_every_path_against_the_bare_exchange():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.moe", "frameworks",
                     "--tokens", "64", "--hidden", "16", "--iters", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    for name in ("mpi4py bare exchange", r"mpi4py bare Alltoall \(padded\)", "NumPy core",
                 "torch Dispatcher"):
        assert re.search(rf"{name}: +[\d.]+ ms \([\d.]+x bare\)", out), (name, out)
    assert re.search(r"JAX Dispatcher \(jit\): +[\d.]+ ms \([\d.]+x bare, [\d.]+x the padded "
                     r"Alltoall\)", out), out
