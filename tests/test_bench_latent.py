"""tools/bench/latent.py at toy sizes on two ranks: the ring's bytes per
token at DeepSeek-V3's sizes (counted, not timed: at least 30x fewer with
the latent), one training row with its three contenders' times, and one
decode row: its times and each rank's share of the latent cache (1/P)."""

import re
import sys

import pytest

import requires
from launch import run

# the full tier only (tests/tiers.py): a benchmark at toy sizes
pytestmark = pytest.mark.full

requires.module("torch")


def test_bench_latent_counts_the_bytes_and_times_the_three_paths():
    result = run(2, [sys.executable, "-m", "commlib.tools.bench.latent", "bytes", "train",
                     "decode", "--seq", "256", "--heads", "2", "--cached", "2048", "--iters",
                     "1"], timeout=300)
    assert result.returncode == 0, result.stdout
    sent = re.search(r"sends (\d+) B a token a layer \(latent\) against (\d+) \(expanded heads\): "
                     r"([\d.]+)x fewer", result.stdout)
    assert sent, result.stdout
    latent, expanded, ratio = int(sent[1]), int(sent[2]), float(sent[3])
    assert latent == (512 + 64) * 4 and expanded == 128 * (192 + 128) * 4 and ratio >= 30
    assert re.search(r"latent ring [\d.]+ s, expanded ring [\d.]+ s \([\d.]+x the latent's; "
                     r"target >= 1\), one process [\d.]+ s", result.stdout), result.stdout
    decode = re.search(r"decode   2 ranks, 2048 cached tokens, 2 heads: latent [\d.]+ ms, "
                       r"expanded [\d.]+ ms .*, one process [\d.]+ ms .*cache per rank \d+ MiB "
                       r"latent against \d+ MiB expanded, ([\d.]+) of the whole", result.stdout)
    assert decode and float(decode[1]) == 0.5, result.stdout
