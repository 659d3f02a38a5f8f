"""tools/bench/placement.py at toy sizes on two ranks: a row per expert kind
and layer (uniform, Zipf, Zipf rebalanced), each with its step against
uniform routing's and its busiest/mean rank, measured and predicted."""

import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy sizes
pytestmark = pytest.mark.full

requires.module("torch")


def test_bench_placement_reports_every_layer_against_uniform_routing():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.placement", "--tokens", "64",
                     "--hidden", "16", "--ffn", "16", "--zipf", "1.2", "--iters", "1"],
                 timeout=300)
    assert result.returncode == 0, result.stdout
    for kind in ("identity", "mlp"):
        for layer, redundant in (("uniform", 0), ("zipf 1.2", 0), ("zipf 1.2 rebalanced", 2)):
            assert re.search(rf"{kind} +{layer} +{redundant} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+",
                             result.stdout), (kind, layer, result.stdout)


def test_bench_placement_moves_reports_the_move_in_place_and_the_floor():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.placement_moves", "--experts",
                     "8", "--hidden", "8", "--ffn", "8", "--iters", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    for name in ("move_expert_weights", "in place", "bare alltoallv", "copy of the weights"):
        assert re.search(rf"{name} +[\d.]+ ms", result.stdout), (name, result.stdout)
    assert re.search(r"ratio [\d.]+x the bare exchange, [\d.]+x the floor .*; in place "
                     r"[\d.]+x the bare exchange", result.stdout), result.stdout
