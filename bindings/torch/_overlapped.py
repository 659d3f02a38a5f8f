"""Differentiable Ulysses overlapped with the caller's Q/K/V projection
(``commlib.ulysses.overlap``): the forward is the core's pipeline, the
projection recorded by autograd as the caller wrote it; the backward is
``ulysses_attention_backward`` group by group (not overlapped), from the
projected shards, the output and its lse.

Not a ``torch.library`` op: the projection is the caller's Python, which no
op can take, so ``torch.compile`` traces the projection and breaks the graph
at each exchange."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from commlib.kernels import Kernel
from commlib.ulysses import overlap
from commlib.ulysses.attention import ulysses_attention_backward


def ulysses_attention_overlapped(project: Callable[[slice, slice], Tuple[torch.Tensor, ...]],
                                 comm, *, num_heads: int, num_kv_heads: Optional[int] = None,
                                 groups: int, layout: str, causal: bool,
                                 softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                                 window: Any = None, mask: Any = None,
                                 kernel: Optional[Kernel] = None,
                                 wire: Optional[str] = None,
                                 softcap: Optional[float] = None) -> torch.Tensor:
    """Differentiable ``commlib.ulysses.ulysses_attention_overlapped``:
    ``project(heads, kv_heads)`` returns this rank's q, k, v shards
    [b, s/P, n, d] for the query and kv heads those slices name (norms and
    rotary embedding included: they act per head); returns out
    [b, s/P, num_heads, d]. ``wire="float8"`` is forward only (refused where
    the projection requires grad)."""
    recording = torch.is_grad_enabled()
    projected: List[Tuple[torch.Tensor, ...]] = []

    def recorded(heads: slice, kv_heads: slice):
        q, k, v = project(heads, kv_heads)
        if wire is not None and recording and any(t.requires_grad for t in (q, k, v)):
            raise ValueError(f"wire={wire!r} is for inference (forward only): the projection "
                             f"requires grad; run it under torch.no_grad() / "
                             f"torch.inference_mode(), or train with wire=None")
        projected.append((q, k, v))
        return q, k, v

    settings = dict(layout=layout, causal=causal, softmax_scale=softmax_scale,
                    cu_seqlens=cu_seqlens, window=window, mask=mask, kernel=kernel,
                    softcap=softcap)
    result = overlap.ulysses_attention_overlapped(
        recorded, comm, num_heads=num_heads, num_kv_heads=num_kv_heads, groups=groups,
        return_lse=recording, wire=wire, **settings)
    shards = [t for group in projected for t in group]
    if not (recording and any(t.requires_grad for t in shards)):
        return result[0] if recording else result
    spans = overlap.head_groups(num_heads, num_heads if num_kv_heads is None else num_kv_heads,
                                groups, comm.size)
    return _Grouped.apply((comm, spans, settings), *result, *shards)


class _Grouped(torch.autograd.Function):
    """out (computed by the pipeline) as a function of every group's q, k,
    v: its backward is each group's ``ulysses_attention_backward``."""

    @staticmethod
    def forward(ctx, how, out, lse, *shards):
        ctx.how = how
        ctx.save_for_backward(out, lse, *shards)
        return out

    @staticmethod
    def backward(ctx, dout):
        comm, spans, settings = ctx.how
        out, lse, *shards = ctx.saved_tensors
        grads = []
        for g, (heads, _) in enumerate(spans):
            q, k, v = shards[3 * g:3 * g + 3]
            grads.extend(ulysses_attention_backward(
                dout[:, :, heads].contiguous(), q, k, v, out[:, :, heads].contiguous(),
                lse[:, heads].contiguous(), comm, **settings))
        return (None, None, None, *grads)
