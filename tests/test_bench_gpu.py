"""tools/gpu/bench.py, which a GPU session runs through tools/gpu_check.sh,
must work before a GPU ever sees it: its CPU smoke mode runs every part and
writes every number."""

import json
import subprocess
import sys

import pytest

import requires

# the full tier only (tests/tiers.py): the GPU benchmark's CPU smoke run
pytestmark = pytest.mark.full

requires.module("torch")


def test_cpu_smoke_run_measures_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    subprocess.run([sys.executable, "-m", "commlib.tools.gpu.bench", "--device", "cpu",
                    "--quick", "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    results = json.loads(out.read_text())
    assert results["device"] == "cpu" and results["quick"] is True
    assert all(row["alltoallv_GBps"] > 0 for row in results["alltoallv"].values())
    attention = results["attention"]
    assert attention["kernel"] == "torch-sdpa" and attention["kernel_TFLOPs"] > 0
    assert attention["ring_s"] > 0 and results["moe"]["dispatch_combine_s"] > 0
    try:
        import jax  # noqa: F401
    except ImportError:
        return
    assert results["jax_attention"]["ring_s"] > 0 and results["jax_attention"]["alone_s"] > 0
    assert results["jax_moe"]["dispatch_combine_grad_s"] > 0
