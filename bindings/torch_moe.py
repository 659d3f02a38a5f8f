"""PyTorch MoE dispatch/combine over ``commlib.moe``: autograd functions whose
backward runs the mirror communication (combine's path for dispatch's
gradient and back). Re-exported by ``bindings.torch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from commlib import moe as _moe

__all__ = ["Dispatcher", "TorchHandle"]


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
    differentiable in x, weights and expert_y; the same options, refusals
    and handles (``commlib.moe.MoEHandle``). With ``quantize="fp8"`` the
    rows are differentiable when ``dequantize=True`` (the quantization is
    passed straight through, the gradient travels back in its own dtype);
    the (values, scales) pair is not. ``pipeline_chunks`` is the core's:
    reading or setting it here reads or sets the core's."""

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None):
        self.core = _moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                                    drop_policy=drop_policy, hierarchical=hierarchical,
                                    max_tokens_per_rank=max_tokens_per_rank,
                                    pipeline_chunks=pipeline_chunks)

    @property
    def pipeline_chunks(self) -> Optional[int]:
        return self.core.pipeline_chunks

    @pipeline_chunks.setter
    def pipeline_chunks(self, chunks: Optional[int]) -> None:
        self.core.pipeline_chunks = chunks  # checked and agreed on by the next dispatch

    @property
    def stats(self) -> _moe.DispatchStats:
        return self.core.stats

    def collect_stats(self) -> _moe.DispatchStats:
        return self.core.collect_stats()

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                 quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, TorchHandle]:
        return self.dispatch_async(x, experts, weights, quantize=quantize,
                                   dequantize=dequantize).wait()

    def dispatch_async(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                       quantize: Optional[str] = None, dequantize: bool = False) -> _Started:
        pending = self.core.dispatch_async(x.detach(), experts, weights.detach(),
                                           quantize=quantize, dequantize=dequantize)
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
