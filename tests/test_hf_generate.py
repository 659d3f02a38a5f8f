"""examples/hf_generate.py under mpiexec: a transformers Llama, and a
Qwen3-MoE made expert-parallel, generate over a sharded KV cache, two turns,
the same tokens as model.generate in one process, the cache spread over the
ranks."""

import re
import sys
from pathlib import Path

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): examples/hf_generate.py at 2 and 3 ranks
# (tests/mpi/test_generate.py tests generate in the quick tier)
pytestmark = pytest.mark.full

requires.module("transformers")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"


@pytest.mark.parametrize("nprocs, model", [(2, "llama"), (3, "qwen3_moe")])
def test_two_turns_are_one_process_generates(nprocs, model):
    result = run(nprocs, [sys.executable, str(EXAMPLE), "--model", model, "--prompt", "101",
                          "--new", "6"], timeout=300)
    assert result.returncode == 0, result.stdout
    assert "the same tokens as model.generate in one process: True" in result.stdout, \
        result.stdout
    held = re.search(r"cached (\d+) tokens, per rank \[([\d, ]+)\]", result.stdout)
    total, per_rank = int(held[1]), [int(n) for n in held[2].split(",")]
    assert sum(per_rank) == total and max(per_rank) <= -(-total // nprocs) + 2, result.stdout
