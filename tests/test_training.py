"""The proof that the pieces compose: a transformer block (context-parallel
attention + expert-parallel MoE) trained for 20 steps under mpiexec follows
the single-process loss curve and ends at the same parameters."""

import re
import sys
from pathlib import Path

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): examples/train_block.py at 2 and 4 ranks
# (the bindings' training tests run in the quick tier)
pytestmark = pytest.mark.full

requires.module("torch")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_block.py"


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("attention", ["ring", "ulysses"])
def test_sharded_training_equals_single_process(nprocs, attention):
    result = run(nprocs, [sys.executable, str(EXAMPLE), attention], timeout=300)
    assert result.returncode == 0, result.stdout
    match = re.search(r"max \|loss difference\| (\S+), max \|parameter difference\| (\S+)",
                      result.stdout)
    assert match, result.stdout
    loss_gap, param_gap = float(match.group(1)), float(match.group(2))
    assert loss_gap < 1e-5 and param_gap < 1e-5, result.stdout
