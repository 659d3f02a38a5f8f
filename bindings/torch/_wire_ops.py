"""Ulysses (and the hybrid's Ulysses stage) with an FP8 wire
(``commlib.ulysses.wire``) as a ``torch.library`` op: one node under
``torch.compile``, like ``_attention_ops.attention``, but forward only.
Where gradients are wanted it is refused on every rank before anything
moves: an FP8 forward beside a full-precision backward would be the
gradient of another function, so training keeps the input dtype on the
wire."""

from __future__ import annotations

from typing import Optional

import torch

from commlib import graph_names

from ._attention_ops import CALL, forward, options_of


def refuse_gradients(comm, algorithm: str, wire: Optional[str], *tensors: torch.Tensor) -> None:
    """Where autograd would record a call with ``wire``, refuse it on every
    rank (the peers meet this refusal in the call's own agreement)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        comm.agree(f"{algorithm}_attention", problem=ValueError(
            f"wire={wire!r} is for inference (forward only): q, k or v requires grad; run it "
            f"under torch.no_grad() / torch.inference_mode(), or train with wire=None"))


def _attention_wire(q, k, v, sinks, cu_seqlens, algorithm, comm, layout, ulysses_size, *values):
    return forward(algorithm, options_of(cu_seqlens, values), q, k, v, graph_names.lookup(comm),
                   layout, ulysses_size, sinks, return_lse=False).contiguous()


attention_wire = torch.library.custom_op(
    "commlib::attention_wire", _attention_wire, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, Tensor? documents, {CALL}) "
           f"-> Tensor")
attention_wire.__doc__ = """out of Ulysses or hybrid attention (``algorithm``) with q, k, v and
out travelling as the options' ``wire``, ``sinks`` in its softmax."""


@attention_wire.register_fake
def _attention_wire_shape(q, *statics):
    return q.new_empty(q.shape)
