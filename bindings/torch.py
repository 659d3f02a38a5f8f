"""PyTorch autograd functions over commlib: Ring, Ulysses and hybrid
attention, the Ulysses relayouts, and MoE dispatch/combine.

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
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from commlib import hybrid as _hybrid
from commlib import moe as _moe
from commlib import ring as _ring
from commlib import ulysses as _ulysses
from commlib.kernels import Kernel

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "seq_to_head",
           "head_to_seq", "Dispatcher"]


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


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, causal: bool = False,
                   layout: str = "contiguous", softmax_scale: Optional[float] = None,
                   cu_seqlens: Any = None, window: Any = None, method: str = "ring",
                   kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.ring.ring_attention`` (packed ``cu_seqlens``,
    sliding ``window``, ``method`` "ring" or "allgather"); ``kernel``
    replaces torch's fused SDPA kernels (``commlib.kernels.Kernel``)."""
    return _attention(q, k, v, _ring.ring_attention, _ring.ring_attention_backward, comm=comm,
                      causal=causal, layout=layout, softmax_scale=softmax_scale,
                      cu_seqlens=cu_seqlens, window=window, method=method, kernel=kernel)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                      causal: bool = False, softmax_scale: Optional[float] = None,
                      cu_seqlens: Any = None, window: Any = None,
                      kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.ulysses.ulysses_attention``."""
    return _attention(q, k, v, _ulysses.ulysses_attention, _ulysses.ulysses_attention_backward,
                      comm=comm, causal=causal, softmax_scale=softmax_scale,
                      cu_seqlens=cu_seqlens, window=window, kernel=kernel)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                     ulysses_size: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                     window: Any = None, method: str = "ring",
                     kernel: Optional[Kernel] = None) -> torch.Tensor:
    """Differentiable ``commlib.hybrid.hybrid_attention``."""
    return _attention(q, k, v, _hybrid.hybrid_attention, _hybrid.hybrid_attention_backward,
                      comm=comm, ulysses_size=ulysses_size, causal=causal,
                      softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, window=window,
                      method=method, kernel=kernel)


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


def seq_to_head(x: torch.Tensor, comm, query_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s/P, h, d] -> [b, s, h_p, d]; its adjoint is head_to_seq."""
    return _SeqToHead.apply(x, comm, query_heads)


def head_to_seq(x: torch.Tensor, comm, heads: Optional[int] = None,
                query_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s, h_p, d] -> [b, s/P, h, d]; its adjoint is seq_to_head."""
    return _HeadToSeq.apply(x, comm, heads, query_heads)


@dataclass
class TorchHandle:
    """A dispatch's handle plus the weights tensor combine differentiates."""

    core: _moe.DispatchHandle
    weights: torch.Tensor

    @property
    def tokens_per_expert(self) -> Any:
        return self.core.tokens_per_expert

    @property
    def stats(self) -> Optional[_moe.DispatchStats]:
        return self.core.stats


class _Dispatch(torch.autograd.Function):
    """expert_x = the started dispatch's result; dx = the expert rows'
    gradients summed back to their tokens along the combine path, computed
    by torch (straight through a quantization)."""

    @staticmethod
    def forward(ctx, x, weights, core, pending, box):
        expert_x, handle = pending.wait()
        box.append(handle)
        ctx.core, ctx.handle = core, handle
        return expert_x

    @staticmethod
    def backward(ctx, grad):
        return ctx.core.dispatch_backward(grad, ctx.handle), None, None, None, None


class _Combine(torch.autograd.Function):
    """y = the started combine's result. Backward, in torch: dy travels the
    dispatch path to the expert rows; d expert_y = w * dy there; d w =
    <dy, expert_y> per slot, sent back to its token."""

    @staticmethod
    def forward(ctx, expert_y, weights, core, handle, pending):
        ctx.save_for_backward(expert_y, weights)
        ctx.core, ctx.handle = core, handle
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        expert_y, weights = ctx.saved_tensors
        d_expert_y, d_weights = ctx.core.combine_backward(expert_y.detach(), grad, ctx.handle,
                                                          weights.shape[1])
        return d_expert_y, d_weights.to(weights.dtype), None, None, None


class _Started:
    """A dispatch or combine in flight whose ``wait()`` records the autograd
    node: the transfer overlaps whatever runs before the wait."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> Any:
        return self._finish()


class Dispatcher:
    """``commlib.moe.Dispatcher`` whose dispatch and combine are
    differentiable in x, weights and expert_y. With ``quantize="fp8"`` the
    rows are differentiable when ``dequantize=True`` (the quantization is
    passed straight through, the gradient travels back in its own dtype);
    the (values, scales) pair is not."""

    def __init__(self, comm, num_experts: int, **options: Any):
        self.core = _moe.Dispatcher(comm, num_experts, **options)

    @property
    def stats(self) -> _moe.DispatchStats:
        return self.core.stats

    def collect_stats(self) -> _moe.DispatchStats:
        return self.core.collect_stats()

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, TorchHandle]:
        return self.dispatch_async(x, experts, weights, quantize, dequantize).wait()

    def dispatch_async(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                       quantize: Optional[str] = None, dequantize: bool = False) -> _Started:
        pending = self.core.dispatch_async(x.detach(), experts, weights.detach(), quantize,
                                           dequantize)
        if quantize is not None and not dequantize:
            def finish():
                values_scales, handle = pending.wait()
                return values_scales, TorchHandle(handle, weights)
            return _Started(finish)

        def finish():
            box: list = []
            expert_x = _Dispatch.apply(x, weights, self.core, pending, box)
            return expert_x, TorchHandle(box[0], weights)
        return _Started(finish)

    def combine(self, expert_y: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        return self.combine_async(expert_y, handle).wait()

    def combine_async(self, expert_y: torch.Tensor, handle: TorchHandle) -> _Started:
        pending = self.core.combine_async(expert_y.detach(), handle.core)
        return _Started(lambda: _Combine.apply(expert_y, handle.weights, self.core, handle.core,
                                               pending))
