"""commlib's torch calls as ``torch.library`` custom ops: what
``torch.compile`` traces as one node each, with no graph break.

An op takes tensors, numbers and strings only: its communicator, mask and
kernel arrive as their names (``commlib.graph_names``), read off the objects
as plain attributes, so the compiler neither breaks the graph at them nor
retraces for an equal mask. The op's body is the eager core (its agreement
on arguments, its MPI or NCCL transfers, torch's kernels), which the
compiler never looks into; its fake implementation gives the shapes and
dtypes, and its backward is another op. ``bindings.torch`` calls these ops
eagerly too: one path, compiled or not.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from commlib import graph_names
from commlib import hybrid as _hybrid
from commlib import ring as _ring
from commlib import ulysses as _ulysses
from commlib.kernels.sinks import sink_gradient
from commlib.namespace import accumulator_dtype
from commlib.ulysses.relayout import kv_heads_for

FORWARD = {"ring": _ring.ring_attention, "ulysses": _ulysses.ulysses_attention,
            "hybrid": _hybrid.hybrid_attention}
_BACKWARD = {"ring": _ring.ring_attention_backward,
             "ulysses": _ulysses.ulysses_attention_backward,
             "hybrid": _hybrid.hybrid_attention_backward}


def attention_settings(algorithm: str, comm: str, layout: str, causal: bool,
              softmax_scale: Optional[float], cu_seqlens: Optional[torch.Tensor],
              cu_seqlens_values: Optional[List[int]], window: Optional[List[int]],
              mask: Optional[str], method: str, kernel: Optional[str],
              ulysses_size: int) -> dict:
    """The core call's keywords, the named objects looked up."""
    settings = dict(comm=graph_names.lookup(comm), layout=layout, causal=causal,
                    softmax_scale=softmax_scale,
                    cu_seqlens=cu_seqlens if cu_seqlens is not None else cu_seqlens_values,
                    window=None if window is None else tuple(window),
                    mask=None if mask is None else graph_names.lookup(mask),
                    kernel=None if kernel is None else graph_names.lookup(kernel))
    if algorithm != "ulysses":
        settings["method"] = method
    if algorithm == "hybrid":
        settings["ulysses_size"] = ulysses_size
    return settings


@torch.library.custom_op("commlib::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], algorithm: str, comm: str, layout: str,
              causal: bool, softmax_scale: Optional[float],
              cu_seqlens_values: Optional[List[int]], window: Optional[List[int]],
              mask: Optional[str], method: str, kernel: Optional[str],
              ulysses_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ring, Ulysses or hybrid attention (``algorithm``), with
    ``sinks`` in its softmax (lse then includes them)."""
    settings = attention_settings(algorithm, comm, layout, causal, softmax_scale, cu_seqlens,
                         cu_seqlens_values, window, mask, method, kernel, ulysses_size)
    out, lse = FORWARD[algorithm](q, k, v, return_lse=True, sinks=sinks, **settings)
    # the fake's layouts: a compiled graph checks strides (lse may be a transposed view)
    return out.contiguous(), lse.contiguous()


@attention.register_fake
def _attention_shapes(q, k, v, sinks, cu_seqlens, algorithm, comm, layout, causal, softmax_scale,
                      cu_seqlens_values, window, mask, method, kernel, ulysses_size):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=accumulator_dtype(q))


@torch.library.custom_op("commlib::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor,
                       cu_seqlens: Optional[torch.Tensor], algorithm: str, comm: str,
                       layout: str, causal: bool, softmax_scale: Optional[float],
                       cu_seqlens_values: Optional[List[int]], window: Optional[List[int]],
                       mask: Optional[str], method: str, kernel: Optional[str],
                       ulysses_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``attention``, from its out and lse (with the sinks:
    dq, dk and dv need nothing else; the sinks' gradient is
    ``_attention_gradients``')."""
    settings = attention_settings(algorithm, comm, layout, causal, softmax_scale, cu_seqlens,
                         cu_seqlens_values, window, mask, method, kernel, ulysses_size)
    grads = _BACKWARD[algorithm](dout.contiguous(), q, k, v, out, lse, **settings)
    return tuple(g.contiguous() for g in grads)


@attention_backward.register_fake
def _attention_backward_shapes(dout, q, k, v, *statics):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_attention(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, *statics = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.cu_seqlens, ctx.statics = cu_seqlens, statics
    ctx.mark_non_differentiable(lse)


def _attention_gradients(ctx, dout, _dlse):
    """dq, dk, dv from the backward op; the sinks' gradient (this rank's
    queries' share) beside it, in torch (``commlib.kernels.sinks``)."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.cu_seqlens, *ctx.statics)
    dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
    return (dq, dk, dv, dsinks) + (None,) * (1 + len(ctx.statics))


attention.register_autograd(_attention_gradients, setup_context=_save_attention)


@torch.library.custom_op("commlib::seq_to_head", mutates_args=())
def seq_to_head(x: torch.Tensor, comm: str, num_heads: Optional[int]) -> torch.Tensor:
    """[b, s/P, h, d] -> [b, s, h_p, d] (``commlib.ulysses.seq_to_head``)."""
    return _ulysses.seq_to_head(x, graph_names.lookup(comm), num_heads)


@seq_to_head.register_fake
def _seq_to_head_shape(x, comm, num_heads):
    group = graph_names.lookup(comm)
    b, s, h, d = x.shape
    mine = kv_heads_for(group.rank, h, group.size, num_heads)
    return x.new_empty((b, s * group.size, len(mine), d))


@torch.library.custom_op("commlib::head_to_seq", mutates_args=())
def head_to_seq(x: torch.Tensor, comm: str, heads: Optional[int],
                num_heads: Optional[int]) -> torch.Tensor:
    """[b, s, h_p, d] -> [b, s/P, h, d] (``commlib.ulysses.head_to_seq``)."""
    return _ulysses.head_to_seq(x, graph_names.lookup(comm), heads, num_heads)


@head_to_seq.register_fake
def _head_to_seq_shape(x, comm, heads, num_heads):
    size = graph_names.lookup(comm).size
    b, s, local, d = x.shape
    return x.new_empty((b, s // size, local * size if heads is None else heads, d))


def _save_seq_to_head(ctx, inputs, output):
    x, ctx.comm, ctx.num_heads = inputs
    ctx.heads = x.shape[2]


def _seq_to_head_gradient(ctx, grad):
    return head_to_seq(grad.contiguous(), ctx.comm, ctx.heads, ctx.num_heads), None, None


def _save_head_to_seq(ctx, inputs, output):
    _, ctx.comm, _, ctx.num_heads = inputs


def _head_to_seq_gradient(ctx, grad):
    return seq_to_head(grad.contiguous(), ctx.comm, ctx.num_heads), None, None, None


seq_to_head.register_autograd(_seq_to_head_gradient, setup_context=_save_seq_to_head)
head_to_seq.register_autograd(_head_to_seq_gradient, setup_context=_save_head_to_seq)


def op_window(window: Any) -> Any:
    """(left, right) as the op's [left, right] (-1: unbounded), None, or
    False where it is not a pair of ints (or None) the core would accept."""
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        return False
    if not all(r is None or (isinstance(r, int) and not isinstance(r, bool))
               for r in (left, right)):
        return False
    return [-1 if r is None else r for r in (left, right)]
