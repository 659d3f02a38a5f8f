"""PyTorch autograd functions over commlib: Ring, Ulysses and hybrid
attention, the Ulysses relayouts, and (re-exported from
``bindings.torch_moe``) MoE dispatch/combine.

Each is a ``torch.autograd.Function`` whose backward runs the mirror
communication (ring_attention_backward, head_to_seq for seq_to_head, combine's
path for dispatch's gradient and back). Tensors cross into commlib through
DLPack without a copy (a contiguous CPU tensor shares its memory) and the
results come back as tensors on the caller's device. The computation is
torch's own, in the tensors' dtype (PyTorch's fused SDPA kernels for the
attention blocks), never NumPy.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from commlib import hybrid as _hybrid
from commlib import ring as _ring
from commlib import ulysses as _ulysses
from commlib.kernels import Kernel

from .torch_moe import Dispatcher, TorchHandle

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "seq_to_head",
           "head_to_seq", "Dispatcher", "TorchHandle"]


class _Attention(torch.autograd.Function):
    """out = forward(q, k, v); the backward calls the matching core backward
    with the forward's out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, forward, backward):
        out, lse = forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backward_fn = backward
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.backward_fn(dout.contiguous(), q, k, v, out, lse), None, None)


def _attention(q, k, v, forward, backward, **settings):
    return _Attention.apply(q, k, v, functools.partial(forward, return_lse=True, **settings),
                            functools.partial(backward, **settings))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *, layout: str,
                   causal: bool, softmax_scale: Optional[float] = None,
                   cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                   method: str = "auto", kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.ring.ring_attention`` (shards in ``layout``,
    packed ``cu_seqlens``, sliding ``window``, or any ``mask``; ``method``
    as ``ring_attention``'s); ``kernel`` replaces torch's fused SDPA kernels
    (``commlib.kernels.Kernel``)."""
    return _attention(q, k, v, _ring.ring_attention, _ring.ring_attention_backward, comm=comm,
                      layout=layout, causal=causal, softmax_scale=softmax_scale,
                      cu_seqlens=cu_seqlens, window=window, mask=mask, method=method,
                      kernel=kernel)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *, layout: str,
                      causal: bool, softmax_scale: Optional[float] = None,
                      cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                      kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.ulysses.ulysses_attention``."""
    return _attention(q, k, v, _ulysses.ulysses_attention, _ulysses.ulysses_attention_backward,
                      comm=comm, layout=layout, causal=causal, softmax_scale=softmax_scale,
                      cu_seqlens=cu_seqlens, window=window, mask=mask, kernel=kernel)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                     ulysses_size: int, *, layout: str, causal: bool,
                     softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                     window: Any = None, mask: Any = None, method: str = "auto",
                     kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.hybrid.hybrid_attention``."""
    return _attention(q, k, v, _hybrid.hybrid_attention, _hybrid.hybrid_attention_backward,
                      comm=comm, ulysses_size=ulysses_size, layout=layout, causal=causal,
                      softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, window=window,
                      mask=mask, method=method, kernel=kernel)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, query_heads):
        ctx.comm, ctx.heads, ctx.query_heads = comm, x.shape[2], query_heads
        return _ulysses.seq_to_head(x, comm, query_heads)

    @staticmethod
    def backward(ctx, grad):
        return (_ulysses.head_to_seq(grad.contiguous(), ctx.comm, ctx.heads, ctx.query_heads),
                None, None)


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, heads, query_heads):
        ctx.comm, ctx.query_heads = comm, query_heads
        return _ulysses.head_to_seq(x, comm, heads, query_heads)

    @staticmethod
    def backward(ctx, grad):
        return _ulysses.seq_to_head(grad.contiguous(), ctx.comm, ctx.query_heads), None, None, None


def seq_to_head(x: torch.Tensor, comm, num_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s/P, h, d] -> [b, s, h_p, d]; its adjoint is head_to_seq."""
    return _SeqToHead.apply(x, comm, num_heads)


def head_to_seq(x: torch.Tensor, comm, heads: Optional[int] = None,
                num_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s, h_p, d] -> [b, s/P, h, d]; its adjoint is seq_to_head."""
    return _HeadToSeq.apply(x, comm, heads, num_heads)
