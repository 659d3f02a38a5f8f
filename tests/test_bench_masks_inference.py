"""tools/bench/masks.py, tools/bench/inference.py (a Llama, and a
Qwen3-MoE through expert_parallel) and tools/bench/small_calls.py at toy
sizes, on two ranks: every line they report is there, and what they check
holds (the greedy tokens of the sharded generate equal one process's; the
balanced layout's spread of the shared-prefix mask)."""

import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): two benchmarks at toy sizes
pytestmark = pytest.mark.full

requires.module("torch")
requires.module("transformers")


def test_bench_masks_reports_balance_bytes_solver_and_times():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.masks", "--seq", "256",
                     "--heads", "2", "--kv-heads", "2", "--head-dim", "8", "--repeats", "1",
                     "--solver-tokens", "8192"], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert re.search(r"# solver: 8192 tokens, 512-token chunks, 8 ranks: [\d.]+ ms", out), out
    assert len(re.findall(r"density [\d.]+: SDPA [\d.]+ s, commlib (ring|sparse) ", out)) == 6
    assert "against SDPA is_causal=True" in out
    assert len(re.findall(r"the planner picks (ring|allgather|sparse|ulysses) \([\d.]+x the "
                          r"fastest\)", out)) == 6, out
    spread = re.findall(r"shared prefix \+ 4 branches +P=\d: balanced ([\d.]+), zigzag ([\d.]+)",
                        out)
    assert len(spread) == 3 and all(float(b) <= 1.10 <= float(z) for b, z in spread), out


@pytest.mark.parametrize("experts", [0, 4], ids=["llama", "qwen3-moe"])
def test_bench_inference_reports_prefill_decode_bytes_and_the_same_tokens(experts):
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.inference", "--seq", "64",
                     "--new", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
                     "--layers", "1", "--repeats", "1", "--threads", "1",
                     "--experts", str(experts)], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    for line in (r"prefill \(to the first token\) +[\d.]+ s vs [\d.]+ s alone: [\d.]+x",
                 r"decode per token +[-\d.]+ ms vs [-\d.]+ ms alone",
                 r"KV cache bytes +\d+ per rank vs \d+ alone: 0\.5\d\d",
                 r"same greedy tokens +True"):
        assert re.search(line, out), (line, out)
    assert ("Qwen3-MoE (4 experts, top-2)" in out) == bool(experts), out


def test_bench_small_calls_reports_each_call_against_its_floor():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.small_calls", "--cached", "64",
                     "--tokens", "8", "--heads", "2", "--head-dim", "8", "--repeat", "1",
                     "--iters", "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    for call in ("decode attention \\(64 cached\\)", "seq_to_head \\(8 tokens\\)",
                 "ring_attention \\(8 tokens\\)"):
        found = re.search(rf"{call}: +[\d.]+ us, floor +[\d.]+ us \([\d.]+x\), (\d+) aten ops",
                          out)
        assert found and int(found[1]) > 0, (call, out)
