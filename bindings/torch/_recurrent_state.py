"""``commlib.recurrent``'s collectives as differentiable torch functions, for
the sharded recurrent mixers: the state entering each piece of a shard and
the tokens before each piece, with gradients through the core's backwards
(the mirror communication), not through autograd of the core."""

from __future__ import annotations

from typing import Any

import torch

from commlib import recurrent

__all__ = ["incoming_state", "halo"]


class _IncomingState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, transition, offset, comm, layout, cu_seqlens, mask):
        ctx.save_for_backward(transition, offset)
        ctx.call = (comm, layout, cu_seqlens, mask)
        return recurrent.incoming_state(transition.detach(), offset.detach(), comm,
                                        layout=layout, cu_seqlens=cu_seqlens, mask=mask)

    @staticmethod
    def backward(ctx, grad_state):
        transition, offset = ctx.saved_tensors
        comm, layout, cu_seqlens, mask = ctx.call
        grad_transition, grad_offset = recurrent.incoming_state_backward(
            grad_state.contiguous(), transition, offset, comm, layout=layout,
            cu_seqlens=cu_seqlens, mask=mask)
        return grad_transition, grad_offset, None, None, None, None


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, width, comm, layout, axis, cu_seqlens, mask):
        ctx.shape = tuple(x.shape)
        ctx.call = (width, comm, layout, axis, cu_seqlens, mask)
        return recurrent.halo(x.detach(), width, comm, layout=layout, axis=axis,
                              cu_seqlens=cu_seqlens, mask=mask)

    @staticmethod
    def backward(ctx, grad_halo):
        width, comm, layout, axis, cu_seqlens, mask = ctx.call
        grad_x = recurrent.halo_backward(grad_halo.contiguous(), ctx.shape, width, comm,
                                         layout=layout, axis=axis, cu_seqlens=cu_seqlens,
                                         mask=mask)
        return grad_x, None, None, None, None, None, None


def incoming_state(transition: torch.Tensor, offset: torch.Tensor, comm, *, layout: str,
                   cu_seqlens: Any = None, mask: Any = None) -> torch.Tensor:
    """``commlib.recurrent.incoming_state``, differentiable in ``transition``
    and ``offset``. Every rank must run the backward (it is collective)."""
    return _IncomingState.apply(transition, offset, comm, layout, cu_seqlens, mask)


def halo(x: torch.Tensor, width: int, comm, *, layout: str, axis: int = 1,
         cu_seqlens: Any = None, mask: Any = None) -> torch.Tensor:
    """``commlib.recurrent.halo``, differentiable in ``x``. Every rank must
    run the backward (it is collective)."""
    return _Halo.apply(x, width, comm, layout, axis, cu_seqlens, mask)
