"""tools/bench/moe/frameworks.py at toy sizes, on two ranks: one line per
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


def test_bench_moe_decode_reports_times_ratios_and_torch_ops():
    """Every contender's time against its bare exchange; the torch pairs
    (commlib's and the plain one a user writes) with their aten ops."""
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.moe", "decode", "--tokens", "2",
                     "--hidden", "16", "--experts", "4", "--topk", "2", "--repeat", "1",
                     "--iters", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    for name, bare in (("NumPy counted", "mpi4py bare exchange"),
                       ("NumPy fixed", r"bare Alltoall \(slots\)")):
        assert re.search(rf"{name}: +[\d.]+ us per pair \([\d.]+x {bare}\)", out), (name, out)
    for name, bare in (("torch plain slots", r"bare Alltoall \(slots\)"),
                       ("torch counted", "mpi4py bare exchange"),
                       ("torch fixed", r"bare Alltoall \(slots\)")):
        found = re.search(rf"{name}: +[\d.]+ us per pair \([\d.]+x {bare}, (\d+) aten ops\)",
                          out)
        assert found and int(found[1]) > 0, (name, out)
