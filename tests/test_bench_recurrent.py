"""tools/bench/recurrent.py at toy sizes: the bytes a recurrent layer
receives are the same at every length while a ring's K/V grow with it, and
the mixers' and the training step's lines report both timings and a ratio."""

import json
import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy size
pytestmark = pytest.mark.full

requires.module("transformers")


def test_bytes_are_flat_in_the_length_and_mixers_report_ratios(tmp_path):
    rows = tmp_path / "bytes.json"
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.recurrent", "bytes",
                     "--lengths", "64,512", "--heads", "2", "--head-dim", "8",
                     "--channels", "16", "--json", str(rows)], timeout=300)
    assert result.returncode == 0, result.stdout
    assert len(re.findall(r"\d+ tokens: recurrent layer +\S+ MiB \(state forward \S+\); "
                          r"ring attention K/V forward +\S+ MiB", result.stdout)) == 2
    short, long = json.loads(rows.read_text())
    # 2 x 8 x 8 float32 state pairs from the one other rank, zigzag: 2 pieces a rank
    assert short["state_forward"] == long["state_forward"] == 2 * 2 * 2 * 8 * 8 * 4
    assert short["all"] == long["all"] and long["ring_kv_forward"] == 8 * short["ring_kv_forward"]
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.recurrent", "mixers",
                     "--length", "96", "--heads", "2", "--head-dim", "8", "--state", "8",
                     "--repeats", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    for name in ("gated_delta_rule", "mamba2_scan"):
        assert re.search(rf"{name}: sharded \S+ ms, one process \S+ ms \(speedup \S+x on 2 "
                         rf"ranks\)", result.stdout), result.stdout
    assert re.search(r"incoming_state .*: \d+ us; bare Allgather \d+ us \(\S+x", result.stdout)
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.recurrent", "train", "--seq",
                     "64", "--hidden", "64", "--repeats", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    assert re.search(r"bench_recurrent train: Qwen3-Next-shaped, 4 layers \(hidden 64\), 64 "
                     r"tokens: 2 ranks x 1 thread \S+ s per step, one process x 2 threads \S+ s "
                     r"\(speedup \S+x\)", result.stdout), result.stdout
