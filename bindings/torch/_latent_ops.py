"""``commlib::latent_attention``: ring or all-gather attention over a latent
(``commlib.ring.latent``) as a ``torch.library`` custom op, one graph node
under ``torch.compile``, its backward another op, as ``_attention_ops``'
attention. The up-projections' gradients are this rank's share (the
ranks' shares add up to them: sum them over the ranks, as any replicated
parameter's, ``allreduce_gradients``)."""

from __future__ import annotations

from typing import Optional

import torch

from commlib import graph_names
from commlib.kernels.sinks import sink_gradient
from commlib.namespace import accumulator_dtype
from commlib.ring.latent import latent_ring_attention_backward_with, latent_ring_attention_with
from commlib.sequence.options import AttentionOptions, graph_schema

from ._attention_ops import graph_arguments, options_of

CALL = "str comm, str layout, " + graph_schema()


def _latent(q, latent, rope_k, w_uk, w_uv, sinks, cu_seqlens, comm, layout, *values):
    out, lse = latent_ring_attention_with(options_of(cu_seqlens, values), q, latent, rope_k,
                                          w_uk, w_uv, graph_names.lookup(comm), layout=layout,
                                          sinks=sinks, return_lse=True)
    return out.contiguous(), lse.contiguous()


latent_attention = torch.library.custom_op(
    "commlib::latent_attention", _latent, mutates_args=(),
    schema=f"(Tensor q, Tensor latent, Tensor rope_k, Tensor w_uk, Tensor w_uv, Tensor? sinks, "
           f"Tensor? documents, {CALL}) -> (Tensor, Tensor)")
latent_attention.__doc__ = """(out, lse) of ``commlib.ring.latent_ring_attention``."""


@latent_attention.register_fake
def _latent_shapes(q, latent, rope_k, w_uk, w_uv, *statics):
    b, s, h, _ = q.shape
    return (q.new_empty((b, s, h, w_uv.shape[-1])),
            q.new_empty((b, h, s), dtype=accumulator_dtype(q)))


def _latent_backward(dout, q, latent, rope_k, w_uk, w_uv, out, lse, cu_seqlens, comm, layout,
                     *values):
    grads = latent_ring_attention_backward_with(
        options_of(cu_seqlens, values), dout.contiguous(), q, latent, rope_k, w_uk, w_uv, out,
        lse, graph_names.lookup(comm), layout=layout)
    dq, d_latent, d_rope, d_uk, d_uv = (g.contiguous() for g in grads)
    return dq, d_latent, d_rope, d_uk.to(w_uk.dtype), d_uv.to(w_uv.dtype)


latent_attention_backward = torch.library.custom_op(
    "commlib::latent_attention_backward", _latent_backward, mutates_args=(),
    schema=f"(Tensor dout, Tensor q, Tensor latent, Tensor rope_k, Tensor w_uk, Tensor w_uv, "
           f"Tensor out, Tensor lse, Tensor? documents, {CALL}) "
           f"-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
latent_attention_backward.__doc__ = """(dq, dlatent, drope_k, dw_uk, dw_uv) of
``latent_attention``, the weights' this rank's share."""


@latent_attention_backward.register_fake
def _latent_backward_shapes(dout, q, latent, rope_k, w_uk, w_uv, *statics):
    return tuple(x.new_empty(x.shape) for x in (q, latent, rope_k, w_uk, w_uv))


def _save(ctx, inputs, output):
    q, latent, rope_k, w_uk, w_uv, sinks, cu_seqlens, *statics = inputs
    out, lse = output
    ctx.save_for_backward(q, latent, rope_k, w_uk, w_uv, out, lse, sinks)
    ctx.cu_seqlens, ctx.statics = cu_seqlens, statics
    ctx.mark_non_differentiable(lse)


def _gradients(ctx, dout, _dlse):
    q, latent, rope_k, w_uk, w_uv, out, lse, sinks = ctx.saved_tensors
    grads = latent_attention_backward(dout, q, latent, rope_k, w_uk, w_uv, out, lse,
                                      ctx.cu_seqlens, *ctx.statics)
    dsinks = None if sinks is None else sink_gradient(dout, out, lse, sinks)
    return (*grads, dsinks) + (None,) * (1 + len(ctx.statics))


latent_attention.register_autograd(_gradients, setup_context=_save)


def latent_call(q, latent, rope_k, w_uk, w_uv, comm, options: AttentionOptions, layout: str,
                sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """The op's out; options no graph can carry go to the core, which
    refuses them on every rank (as ``bindings.torch``'s attention)."""
    carried = graph_arguments(options, sinks)
    if carried is None:
        return latent_ring_attention_with(options, q, latent, rope_k, w_uk, w_uv, comm,
                                          layout=layout, sinks=sinks)
    documents, values = carried
    out, _ = latent_attention(q, latent, rope_k, w_uk, w_uv, sinks, documents, comm.handle,
                              layout, *values)
    return out
