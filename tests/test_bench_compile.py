"""tools/bench/compile.py at toy sizes: both blocks compile and report eager
and compiled step times, and each per-call line its parts and ratio."""

import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy size
pytestmark = pytest.mark.full

requires.module("transformers")


def test_blocks_and_calls_on_two_ranks_report_times_and_ratios():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.compile", "--seq", "16",
                     "--hidden", "64", "--calls", "32", "--repeats", "1"], timeout=600)
    assert result.returncode == 0, result.stdout
    for family in ("llama", "qwen3_moe"):
        assert re.search(rf"{family} block, 2 ranks x 16 tokens, hidden 64: eager \S+ ms, "
                         rf"compiled \S+ ms per step \(compiled/eager \S+; first compiled "
                         rf"call \S+ s\)", result.stdout), result.stdout
    assert re.search(r"ring_attention, 32 tokens per rank: \d+ us; bare Sendrecv \d+ us \+ "
                     r"SDPA \d+ us; overhead \S+x", result.stdout), result.stdout
    assert re.search(r"seq_to_head, 32 tokens per rank: \d+ us; bare Alltoall \d+ us; "
                     r"overhead \S+x", result.stdout), result.stdout
