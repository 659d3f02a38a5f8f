"""Ulysses (and the hybrid's Ulysses stage) with an FP8 wire
(``commlib.ulysses.wire``) as a ``torch.library`` op: one node under
``torch.compile``, like ``_attention_ops.attention``, but forward only.
Where gradients are wanted it is refused on every rank before anything
moves: an FP8 forward beside a full-precision backward would be the
gradient of another function, so training keeps the input dtype on the
wire."""

from __future__ import annotations

from typing import List, Optional

import torch

from ._attention_ops import FORWARD, attention_settings


def refuse_gradients(comm, algorithm: str, wire: Optional[str], *tensors: torch.Tensor) -> None:
    """Where autograd would record a call with ``wire``, refuse it on every
    rank (the peers meet this refusal in the call's own agreement)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        comm.agree(f"{algorithm}_attention", problem=ValueError(
            f"wire={wire!r} is for inference (forward only): q, k or v requires grad; run it "
            f"under torch.no_grad() / torch.inference_mode(), or train with wire=None"))


@torch.library.custom_op("commlib::attention_wire", mutates_args=())
def attention_wire(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   sinks: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                   algorithm: str, comm: str, layout: str,
                   causal: bool, softmax_scale: Optional[float],
                   cu_seqlens_values: Optional[List[int]], window: Optional[List[int]],
                   mask: Optional[str], method: str, kernel: Optional[str],
                   ulysses_size: int, wire: str) -> torch.Tensor:
    """out of Ulysses or hybrid attention (``algorithm``) with q, k, v and
    out travelling as ``wire``, ``sinks`` in its softmax."""
    settings = attention_settings(algorithm, comm, layout, causal, softmax_scale, cu_seqlens,
                         cu_seqlens_values, window, mask, method, kernel, ulysses_size)
    return FORWARD[algorithm](q, k, v, wire=wire, sinks=sinks, **settings).contiguous()


@attention_wire.register_fake
def _attention_wire_shape(q, *statics):
    return q.new_empty(q.shape)
