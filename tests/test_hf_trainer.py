"""examples/hf_trainer.py under mpiexec: the Trainer (and TRL's
SFTTrainer) logs the same steps and eval_loss at 2 ranks (context-parallel)
as in one process, and at 4 (two data-parallel groups of two) as two
groups of one."""

import re
import sys
from pathlib import Path

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): the example at 1, 2 and 4 ranks
# (tests/mpi/test_trainer.py tests the same in the quick tier)
pytestmark = pytest.mark.full

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"


def logged(nprocs, *options):
    result = run(nprocs, [sys.executable, str(EXAMPLE), "--steps", "4", "--seq", "48",
                          *options], timeout=300)
    assert result.returncode == 0, result.stdout
    steps = re.findall(r"loss (\S+)  grad_norm (\S+)", result.stdout)
    assert len(steps) == 4, result.stdout
    return [float(v) for step in steps for v in step] + [
        float(v) for v in re.findall(r"eval_loss (\S+)", result.stdout)]


def close(got, want):
    return len(got) == len(want) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want))


# (Qwen3-MoE with its experts split: tests/mpi/test_trainer.py)
@pytest.mark.parametrize("options", [(), ("--trl",)])
def test_the_example_logs_what_one_process_logs(options):
    for name in ("transformers", "accelerate", "trl"):  # asked here: the GPU check collects
        requires.module(name)                            # this file without the trainer extra
    assert close(logged(2, *options), logged(1, *options))
    if not options:  # two data-parallel groups (twice the batch): of 1 rank, then of 2
        assert close(logged(4, "--cp-size", "2"), logged(2, "--cp-size", "1"))
