"""Ring Attention, forward and backward, in the caller's framework.

Each rank holds a shard of the sequence (q, k, v [batch, seq/P, heads, dim]).
K and V travel around the ring; at every step each rank attends its queries
to the block it holds with the block kernel (PyTorch's fused SDPA ops for
torch tensors, the tiled array-API kernel otherwise, or the caller's
``kernel``) and merges the result into its running output with the online
softmax, in float32 (float64 for float64 inputs). Which (query, key) pairs
are visible (causality, packed documents ``cu_seqlens``, a sliding
``window``, padding) decides which blocks of a step are computed at all
(``commlib.sequence.visibility``); zigzag layouts make every step cost about the same
on every rank. Only bytes cross into the Communicator: K and V in their own
dtype (bfloat16 moves half the bytes of float32).

Backward: dQ accumulates locally; dK and dV for a block accumulate in float32
(float64 for float64 inputs) and travel one hop behind their K/V block, each
rank adding its part, so that after P steps each block's gradients arrive at
its owner.

``method="allgather"`` gathers K and V once instead (one collective; every
rank then attends to the whole sequence: Llama 3's context parallelism) and
its backward reduce-scatters dK and dV; it pays no per-step merge and wins
where K and V are small next to Q (GQA with few kv heads).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..kernels import Kernel
from ..kernels.sinks import with_sink_gradient
from ..namespace import contiguous, detached, device, namespace
from ..sequence.attention_call import AttentionCall, backward_extras, prepare
from ..sequence.blockwise import attend, attend_backward, finish
from ..sequence.kv import joined, split
from ..sequence.options import AttentionOptions
from .exchange import RingExchange
from .sparse import SPARSE_SHARE, routes, sparse_backward, sparse_forward

METHODS = ("auto", "ring", "allgather", "sparse")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")


def ring_attention(q: Any, k: Any, v: Any, comm, *, layout: str, causal: bool,
                   softmax_scale: Optional[float] = None, return_lse: bool = False,
                   cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                   method: str = "auto", kernel: Optional[Kernel] = None,
                   sinks: Any = None, softcap: Optional[float] = None):
    """Attention of this rank's queries over the whole (sharded) sequence.

    q [b, s/P, h, d]; k, v [b, s/P, hk, d] with h % hk == 0; shards as
    ``shard_sequence(..., layout=layout, cu_seqlens=...)`` makes them (the
    layout has no default: shards and attention must name the same one).
    ``cu_seqlens``: offsets of the documents packed in the GLOBAL sequence
    (attention never crosses a document; padding is masked); ``window``:
    (left, right) tokens a query sees around itself; ``mask``: any mask
    instead of those three (``commlib.sequence.masks.Mask``: slices of the GLOBAL
    sequence; with ``layout="balanced"``, shards that spread its work
    evenly); ``method``: "ring", "allgather", "sparse" (each rank receives only the keys its
    queries see: ``ring.sparse``) or "auto" (sparse where a mask makes it
    move clearly less, else the ring). Returns out (q's
    framework, device and dtype) and, with ``return_lse``, lse [b, h, s/P]
    float32 (float64 for float64 q). ``kernel`` replaces the
    built-in block kernel (``commlib.kernels``). ``sinks`` [h]: one logit
    per query head that joins every softmax as a column with no value
    (gpt-oss; ``commlib.kernels.sinks``); the lse returned then includes
    it (what the backward takes). ``softcap``: every score s (after the
    scale) becomes softcap * tanh(s / softcap) before the softmax (Gemma2,
    Grok; the sinks are not capped); it runs the tiled kernel, as PyTorch's
    fused SDPA cannot cap (``commlib.kernels``)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return ring_attention_with(options, q, k, v, comm, layout=layout, sinks=sinks,
                               return_lse=return_lse)


def ring_attention_with(options: AttentionOptions, q: Any, k: Any, v: Any, comm, *,
                        layout: str, sinks: Any = None, return_lse: bool = False):
    """``ring_attention`` with its options as one value (what the bindings
    call)."""
    q, k, v, sinks = detached(q, k, v, sinks)
    call = prepare(comm, "ring_attention", q, k, v, options, layout=layout, sinks=sinks,
                   check=lambda: check_method(options.method))
    out, lse = ring_forward(call, q, k, v, comm, options.method, sinks)
    return (out, lse) if return_lse else out


def ring_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm, *,
                            layout: str, causal: bool,
                            softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                            window: Any = None, mask: Any = None, method: str = "auto",
                            kernel: Optional[Kernel] = None, sinks: Any = None,
                            softcap: Optional[float] = None):
    """(dq, dk, dv) of ``ring_attention`` for this rank's shards, given the
    forward's ``out`` and ``lse`` and the output gradient ``dout``; in q's
    framework, device and dtype. With ``sinks`` (the forward's): (dq, dk, dv,
    dsinks), dsinks this rank's queries' share of the sinks' gradient (the
    ranks' shares add up to it: ``commlib.kernels.sinks``)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return ring_attention_backward_with(options, dout, q, k, v, out, lse, comm, layout=layout,
                                        sinks=sinks)


def ring_attention_backward_with(options: AttentionOptions, dout: Any, q: Any, k: Any, v: Any,
                                 out: Any, lse: Any, comm, *, layout: str, sinks: Any = None):
    """``ring_attention_backward`` with its options as one value."""
    dout, q, k, v, out, lse, sinks = detached(dout, q, k, v, out, lse, sinks)
    call = prepare(comm, "ring_attention_backward", q, k, v, options, layout=layout,
                   extra=backward_extras(q, v, dout, out, lse), sinks=sinks,
                   check=lambda: check_method(options.method))
    grads = ring_backward(call, dout, q, k, v, out, lse, comm, options.method)
    return with_sink_gradient(grads, dout, out, lse, sinks)


def resolved(call: AttentionCall, comm, method: str) -> str:
    """``method``, with "auto" decided: the sparse exchange where a mask
    makes it move at most ``SPARSE_SHARE`` of the ring's bytes (the same
    choice on every rank: the routes come from the mask), else the ring."""
    if method != "auto":
        return method
    if call.mask is None or comm.size == 1:
        return "ring"
    share = routes(call.mask, call.placement).busiest_share()
    return "sparse" if share <= SPARSE_SHARE else "ring"


def ring_forward(call: AttentionCall, q: Any, k: Any, v: Any, comm, method: str,
                 sinks: Any = None):
    """(out, lse) of checked and agreed inputs: the ring over ``comm``, whose
    ranks hold ``call.placement``'s shards; ``sinks`` those of q's heads,
    applied once every block is merged."""
    placement = call.placement
    mine = placement.spans(comm.rank)
    method = resolved(call, comm, method)
    if method == "sparse":
        return finish(sparse_forward(call, q, k, v, comm), q, sinks, v.shape[-1])
    if method == "allgather":
        order, spans = placement.in_order()
        kv = in_order(comm.allgather(joined(k, v), axis=2), order, axis=2)
        state = attend(call.kernel, q, *split(kv, k.shape[-1]), call.blocks(mine, spans),
                       call.scale)
    else:
        state = None
        for source, block in RingExchange(comm).rotate(joined(k, v)):
            state = attend(call.kernel, q, *split(block, k.shape[-1]),
                           call.blocks(mine, placement.spans(source)), call.scale, state)
    return finish(state, q, sinks, v.shape[-1])


def ring_backward(call: AttentionCall, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                  comm, method: str, *, accumulated: bool = False):
    """(dq, dk, dv) of checked and agreed inputs (``ring_forward``'s mirror);
    ``accumulated``: dk and dv left in the accumulator dtype, for a caller
    that reduces them further (the latent's contraction)."""
    xp, placement, kernel, scale = call.xp, call.placement, call.kernel, call.scale
    mine = placement.spans(comm.rank)
    dq = None
    method = resolved(call, comm, method)
    if method == "sparse":
        dq, own = sparse_backward(call, dout, q, k, v, out, lse, comm)
    elif method == "allgather":
        order, spans = placement.in_order()
        kv = in_order(comm.allgather(joined(k, v), axis=2), order, axis=2)
        dq, dkv = attend_backward(kernel, dout, q, *split(kv, k.shape[-1]), out, lse,
                                  call.blocks(mine, spans), scale)
        own = reduce_scattered(in_order(dkv, np.argsort(order), axis=2), comm, axis=2)
    else:
        carried = None  # dK and dV of the block one hop ahead, on their way around
        for source, block in RingExchange(comm).rotate(joined(k, v)):
            dq, grads = attend_backward(kernel, dout, q, *split(block, k.shape[-1]), out, lse,
                                        call.blocks(mine, placement.spans(source)), scale, dq)
            if carried is not None:
                grads += carried.wait()
            carried = comm.ring_shift_async(grads, lane=1)  # overlaps the next K/V hop
        own = carried.wait()  # this rank's own block, every rank's part added
    dk, dv = split(own, k.shape[-1])
    if accumulated:
        return xp.astype(dq, q.dtype), dk, dv
    return xp.astype(dq, q.dtype), xp.astype(dk, k.dtype), xp.astype(dv, v.dtype)


def in_order(x: Any, order: np.ndarray, axis: int) -> Any:
    """``x`` with its sequence ``axis`` permuted by ``order`` (gathered shards
    back in sequence order, or the way back)."""
    xp = namespace(x)
    return xp.take(x, xp.asarray(order, device=device(x)), axis=axis)


def reduce_scattered(x: Any, comm, axis: int) -> Any:
    """Partial sums over the whole sequence (``axis``: P shards long) on every
    rank -> this rank's shard summed over ranks (an all-to-all, then a local sum)."""
    xp = namespace(x)
    shape = tuple(x.shape)
    per_rank = xp.reshape(x, shape[:axis] + (comm.size, shape[axis] // comm.size)
                          + shape[axis + 1:])
    leading = xp.permute_dims(per_rank, (axis, *range(axis), *range(axis + 1, len(shape) + 1)))
    return xp.sum(comm.alltoall(contiguous(leading)), axis=0)
