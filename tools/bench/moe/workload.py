"""The torch problem ``modes``, ``decode`` and ``overlap`` time: bfloat16
rows with their top-k routing, and commlib's dispatch + combine pair of
them with identity experts."""

from __future__ import annotations

from typing import Optional

import numpy as np

from commlib import moe


def torch_routing(comm, tokens: int, hidden: int, num_experts: int, topk: int, seed: int = 0):
    """bf16 torch rows and a top-k softmax routing, this rank's own."""
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng([seed, comm.rank])
    x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32)).bfloat16()
    experts, weights = moe.route(torch.from_numpy(rng.standard_normal(
        (tokens, num_experts)).astype(np.float32)), topk)
    return x, experts, weights


def dispatch_combine(d: moe.Dispatcher, x, experts, weights, quantize: Optional[str] = None):
    """Dispatch + combine with identity experts (FP8 rows dequantized)."""
    def run():
        expert_x, handle = d.dispatch(x, experts, weights, quantize=quantize,
                                      dequantize=quantize is not None)
        return d.combine(expert_x, handle)
    return run
