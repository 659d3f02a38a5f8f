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

The attention ops take the call's options (``AttentionOptions``) as their
fields, in the schema the options derive (``graph_schema``: one typed
argument per field, named objects by name), so an option added there
reaches every op without a change here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch

from commlib import graph_names
from commlib import ulysses as _ulysses
from commlib.hybrid.attention import hybrid_attention_backward_with, hybrid_attention_with
from commlib.kernels.sinks import sink_gradient
from commlib.namespace import accumulator_dtype
from commlib.ring.attention import ring_attention_backward_with, ring_attention_with
from commlib.sequence.options import AttentionOptions, graph_schema
from commlib.ulysses.attention import ulysses_attention_backward_with, ulysses_attention_with
from commlib.ulysses.relayout import kv_heads_for

# what every attention op takes before the options' own fields
# (``AttentionOptions.graph_values``): a new option reaches the ops by itself
CALL = "str algorithm, str comm, str layout, int ulysses_size, " + graph_schema()


def forward(algorithm: str, options: AttentionOptions, q: Any, k: Any, v: Any, comm, layout: str,
            ulysses_size: int, sinks: Any, return_lse: bool) -> Any:
    """out (and lse, with ``return_lse``) of the core's ring, Ulysses or
    hybrid attention."""
    if algorithm == "hybrid":
        return hybrid_attention_with(options, q, k, v, comm, ulysses_size, layout=layout,
                                     sinks=sinks, return_lse=return_lse)
    run = ring_attention_with if algorithm == "ring" else ulysses_attention_with
    return run(options, q, k, v, comm, layout=layout, sinks=sinks, return_lse=return_lse)


def _backward(algorithm: str, options: AttentionOptions, dout, q, k, v, out, lse, comm,
              layout: str, ulysses_size: int):
    if algorithm == "hybrid":
        return hybrid_attention_backward_with(options, dout, q, k, v, out, lse, comm,
                                              ulysses_size, layout=layout)
    run = ring_attention_backward_with if algorithm == "ring" \
        else ulysses_attention_backward_with
    return run(options, dout, q, k, v, out, lse, comm, layout=layout)


def options_of(cu_seqlens: Optional[torch.Tensor], values: tuple) -> AttentionOptions:
    """The options an op was given: its options' values, and the documents'
    offsets where they came as a tensor."""
    options = AttentionOptions.from_graph_values(*values)
    return options if cu_seqlens is None else replace(options, cu_seqlens=cu_seqlens)


def graph_arguments(options: AttentionOptions, sinks: Any) -> Optional[tuple]:
    """(documents, option values) an op takes for ``options`` and ``sinks``:
    the documents' offsets as a tensor where they are one; None where no
    graph can carry them (a window that is not a (left, right) pair of token
    counts, a cap that is not a number, sinks that are not a tensor): the
    caller runs the core, which refuses them on every rank."""
    documents = options.cu_seqlens if isinstance(options.cu_seqlens, torch.Tensor) else None
    values = (options if documents is None else options.without("cu_seqlens")).graph_values()
    if values is None or not (sinks is None or isinstance(sinks, torch.Tensor)):
        return None
    return documents, values


def _attention(q, k, v, sinks, cu_seqlens, algorithm, comm, layout, ulysses_size, *values):
    out, lse = forward(algorithm, options_of(cu_seqlens, values), q, k, v,
                       graph_names.lookup(comm), layout, ulysses_size, sinks, return_lse=True)
    # the fake's layouts: a compiled graph checks strides (lse may be a transposed view)
    return out.contiguous(), lse.contiguous()


attention = torch.library.custom_op(
    "commlib::attention", _attention, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? documents, {CALL}) "
           f"-> (Tensor, Tensor)")
attention.__doc__ = """(out, lse) of ring, Ulysses or hybrid attention (``algorithm``), with
``sinks`` in its softmax (lse then includes them)."""


@attention.register_fake
def _attention_shapes(q, k, v, *statics):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=accumulator_dtype(q))


def _attention_backward(dout, q, k, v, out, lse, cu_seqlens, algorithm, comm, layout,
                        ulysses_size, *values):
    grads = _backward(algorithm, options_of(cu_seqlens, values), dout.contiguous(), q, k, v,
                      out, lse, graph_names.lookup(comm), layout, ulysses_size)
    return tuple(g.contiguous() for g in grads)


attention_backward = torch.library.custom_op(
    "commlib::attention_backward", _attention_backward, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
           f"Tensor? documents, {CALL}) -> (Tensor, Tensor, Tensor)")
attention_backward.__doc__ = """(dq, dk, dv) of ``attention``, from its out and lse (with the
sinks: dq, dk and dv need nothing else; the sinks' gradient is ``_attention_gradients``')."""


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

