"""Ulysses attention: swap the sequence-sharded layout for a head-sharded
one (one all-to-all for q, k and v together), attend over the whole
sequence for this rank's heads with the block kernel of the arrays'
framework (``commlib.kernels``), swap back. The backward pass is the mirror
image. Everything runs in the caller's framework, device and dtype.

Packed documents (``cu_seqlens``), padding and a sliding ``window`` decide
which blocks of the whole sequence the kernel runs on
(``commlib.sequence.visibility``). The gathered sequence is attended in sequence
order whatever the shards' layout (a zigzag one is permuted back first):
one causal call for a plain sequence."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ..kernels import Kernel
from ..kernels.sinks import with_sink_gradient
from ..namespace import detached, device
from ..sequence.attention_call import AttentionCall, backward_extras, prepare
from ..sequence.blockwise import attend, attend_backward, finish
from ..sequence.kv import split
from ..sequence.options import AttentionOptions
from .relayout import (
    check_heads,
    head_to_seq,
    heads_here,
    lse_to_heads,
    lse_to_seq,
    seq_to_head_many,
)
from .wire import check_wire


def ulysses_attention(q: Any, k: Any, v: Any, comm, *, layout: str, causal: bool,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                      kernel: Optional[Kernel] = None, sinks: Any = None,
                      wire: Optional[str] = None, softcap: Optional[float] = None):
    """Attention over the whole sequence for sequence shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d] in ``layout`` (any of
    ``commlib.ring.LAYOUTS``, as ``shard_sequence`` makes them; no default:
    shards and attention must name the same one) with h >= P (heads split
    unevenly where P does not divide them: ``relayout``); ``cu_seqlens``,
    ``window``, ``mask`` and ``sinks`` (all h heads') as ``ring_attention``'s.
    Returns out [b, s/P, h, d] (q's framework, device and dtype) and, with
    ``return_lse``, lse [b, h, s/P] float32 (float64 for float64 q).
    ``wire="float8"``: q, k, v and out travel as e4m3 with per-head scales
    (``commlib.ulysses.wire``); ``softcap`` as ``ring_attention``'s."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               wire=wire)
    return ulysses_attention_with(options, q, k, v, comm, layout=layout, sinks=sinks,
                                  return_lse=return_lse)


def ulysses_attention_with(options: AttentionOptions, q: Any, k: Any, v: Any, comm, *,
                           layout: str, sinks: Any = None, return_lse: bool = False):
    """``ulysses_attention`` with its options as one value (what the
    bindings call)."""
    q, k, v, sinks = detached(q, k, v, sinks)
    wire = options.wire
    call = prepare(comm, "ulysses_attention", q, k, v, options, layout=layout, sinks=sinks,
                   check=lambda: (check_heads(q.shape[2], comm.size), check_wire(wire, q)))
    heads = q.shape[2]
    out, lse = ulysses_forward(call, *seq_to_head_many([q, k, v], comm, wire=wire),
                               sinks=heads_here(sinks, comm))
    result = head_to_seq(out, comm, heads, wire=wire)  # finish gave it q's dtype
    return (result, lse_to_seq(lse, comm, heads)) if return_lse else result


def ulysses_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm, *,
                               layout: str, causal: bool,
                               softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                               window: Any = None, mask: Any = None,
                               kernel: Optional[Kernel] = None, sinks: Any = None,
                               softcap: Optional[float] = None):
    """(dq, dk, dv) of ``ulysses_attention`` for this rank's shards, in q's
    framework, device and dtype; with ``sinks``, (dq, dk, dv, dsinks) as
    ``ring_attention_backward``'s."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel)
    return ulysses_attention_backward_with(options, dout, q, k, v, out, lse, comm,
                                           layout=layout, sinks=sinks)


def ulysses_attention_backward_with(options: AttentionOptions, dout: Any, q: Any, k: Any,
                                    v: Any, out: Any, lse: Any, comm, *, layout: str,
                                    sinks: Any = None):
    """``ulysses_attention_backward`` with its options as one value (the
    backward moves q's dtype: no ``wire``)."""
    dout, q, k, v, out, lse, sinks = detached(dout, q, k, v, out, lse, sinks)
    call = prepare(comm, "ulysses_attention_backward", q, k, v, options, layout=layout,
                   extra=backward_extras(q, v, dout, out, lse), sinks=sinks,
                   check=lambda: check_heads(q.shape[2], comm.size))
    qh, kh, vh, dh, oh = seq_to_head_many([q, k, v, dout, out], comm)
    dq, dk, dv = ulysses_backward(call, dh, qh, kh, vh, oh, lse_to_heads(lse, comm))
    heads, kv_heads = q.shape[2], k.shape[2]
    grads = (head_to_seq(_cast(call, dq, q), comm, heads),
             head_to_seq(_cast(call, dk, k), comm, kv_heads, heads),
             head_to_seq(_cast(call, dv, v), comm, kv_heads, heads))
    return with_sink_gradient(grads, dout, out, lse, sinks)


def ulysses_forward(call: AttentionCall, q: Any, k: Any, v: Any, sinks: Any = None):
    """(out, lse) over the whole gathered sequence (q, k, v [b, s, h_p, d],
    every rank's shard one after the other), attended in sequence order;
    ``sinks`` those of the h_p heads held here."""
    order, spans = call.placement.in_order()
    q, k, v = _permuted(call, order, (q, k, v), axis=1)
    whole = call.blocks(spans, spans)
    out, lse = finish(attend(call.kernel, q, k, v, whole, call.scale), q, sinks, v.shape[-1])
    back = np.argsort(order)
    return _permuted(call, back, (out,), axis=1)[0], _permuted(call, back, (lse,), axis=2)[0]


def ulysses_backward(call: AttentionCall, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any):
    """(dq, dk, dv), in the accumulator dtype, over the whole gathered
    sequence (``ulysses_forward``'s mirror)."""
    order, spans = call.placement.in_order()
    dout, q, k, v, out = _permuted(call, order, (dout, q, k, v, out), axis=1)
    (lse,) = _permuted(call, order, (lse,), axis=2)
    dq, dkv = attend_backward(call.kernel, dout, q, k, v, out, lse, call.blocks(spans, spans),
                              call.scale)
    return _permuted(call, np.argsort(order), (dq, *split(dkv, k.shape[-1])), axis=1)


def _cast(call: AttentionCall, x: Any, like: Any) -> Any:
    return call.xp.astype(x, like.dtype)


def _permuted(call: AttentionCall, order: np.ndarray, arrays: Sequence[Any], axis: int):
    """``arrays`` with ``axis`` taken in ``order`` (untouched where it is
    the identity: a contiguous layout)."""
    if np.array_equal(order, np.arange(order.size)):
        return tuple(arrays)
    index = call.xp.asarray(order, device=device(arrays[0]))
    return tuple(call.xp.take(x, index, axis=axis) for x in arrays)
