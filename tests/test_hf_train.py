"""examples/hf_train.py under mpiexec: a transformers Llama (Ring) and a
Qwen3-MoE (Ulysses or the hybrid, with expert parallelism) trained sharded
follow the single-process loss at every step."""

import re
import sys
from pathlib import Path

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): examples/hf_train.py at 2-4 ranks
# (tests/mpi/test_transformers_*.py test the same in the quick tier)
pytestmark = pytest.mark.full

requires.module("transformers")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_train.py"


@pytest.mark.parametrize("nprocs, model, attn", [(2, "llama", "commlib_ring"),
                                                 (4, "qwen3_moe", "commlib_ulysses"),
                                                 (4, "qwen3_moe", "commlib_hybrid")])
def test_sharded_losses_follow_the_single_process_ones(nprocs, model, attn):
    steps = 5
    result = run(nprocs, [sys.executable, str(EXAMPLE), "--model", model, "--attn", attn,
                          "--steps", str(steps), "--seq", "64"], timeout=300)
    assert result.returncode == 0, result.stdout
    pairs = re.findall(r"loss (\S+) on \d+ ranks .* (\S+) in one process", result.stdout)
    assert len(pairs) == steps, result.stdout
    assert all(abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) for a, b in pairs), result.stdout
    assert float(pairs[-1][1]) < float(pairs[0][1])  # it trains
