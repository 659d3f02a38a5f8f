"""Ulysses x Ring (USP): Ulysses inside groups of ``ulysses_size``
consecutive ranks, Ring Attention across the groups.

The input is sharded by world rank in any layout (``commlib.sequence.documents``).
Inside group g (ranks g*u .. g*u+u-1) seq_to_head gathers the group's
shards, one after the other, for a u-th of the heads; the ranks at the same
position of every group form a ring of R = P/u ranks, in which rank g holds
group g's shards (``documents.Grouped``): Ring Attention over them, every
block's visibility read from where its tokens sit. Then head_to_seq inside
the group. A zigzag layout balances the causal work across the groups as it
does across a ring's ranks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..kernels import Kernel
from ..kernels.sinks import with_sink_gradient
from ..namespace import detached
from ..ring.attention import check_method, ring_backward, ring_forward
from ..sequence.attention_call import backward_extras, prepare
from ..sequence.options import AttentionOptions
from ..ulysses.relayout import (
    check_heads,
    divisors,
    head_to_seq,
    heads_here,
    lse_to_heads,
    lse_to_seq,
    seq_to_head_many,
)
from ..ulysses.wire import check_wire


def check_degree(size: int, ulysses_size: int) -> None:
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) \
            or ulysses_size < 1 or size % ulysses_size:
        raise ValueError(f"ulysses_size={ulysses_size!r} must divide the world size {size}; "
                         f"use one of {divisors(size)}")


def colors(rank: int, ulysses_size: int) -> Tuple[int, int]:
    """(Ulysses group, ring) of ``rank``: groups of ``ulysses_size``
    consecutive ranks, rings of the ranks at the same position of every
    group, each ordered by rank. The one place that says so: ``groups``
    splits by it and the planner prices by it."""
    return rank // ulysses_size, rank % ulysses_size


def groups(comm, ulysses_size: int) -> Tuple[Any, Any]:
    """(Ulysses group, ring) sub-communicators of ``comm``, made once per
    degree (collective the first time), owned by ``comm`` and freed with it."""
    group, ring = colors(comm.rank, ulysses_size)
    return (comm.split(group, key=comm.rank, cache_key=("hybrid.ulysses", ulysses_size)),
            comm.split(ring, key=comm.rank, cache_key=("hybrid.ring", ulysses_size)))


def _check(q, size: int, ulysses_size: int, method: str) -> None:
    check_degree(size, ulysses_size)
    check_heads(q.shape[2], ulysses_size)
    check_method(method)


def hybrid_attention(q: Any, k: Any, v: Any, comm, ulysses_size: int, *, layout: str,
                     causal: bool, softmax_scale: Optional[float] = None,
                     return_lse: bool = False, cu_seqlens: Any = None, window: Any = None,
                     mask: Any = None, method: str = "auto", kernel: Optional[Kernel] = None,
                     sinks: Any = None, wire: Optional[str] = None,
                     softcap: Optional[float] = None):
    """Attention over the whole sequence for shards q [b, s/P, h, d],
    k/v [b, s/P, hk, d] in ``layout`` (any of ``commlib.ring.LAYOUTS``; no
    default: shards and attention must name the same one): Ulysses of
    degree ``ulysses_size`` inside groups, a ring (``method`` as
    ``ring_attention``'s) of P / ulysses_size across them; ``cu_seqlens``,
    ``window``, ``mask`` and ``sinks`` (all h heads', applied once, after the
    ring) as ``ring_attention``'s. In q's framework, device and dtype.
    ``wire="float8"``: the Ulysses all-to-alls travel as e4m3 with per-head
    scales (``commlib.ulysses.wire``); the ring's K/V in q's dtype.
    ``softcap`` as ``ring_attention``'s."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method, wire=wire)
    return hybrid_attention_with(options, q, k, v, comm, ulysses_size, layout=layout,
                                 sinks=sinks, return_lse=return_lse)


def hybrid_attention_with(options: AttentionOptions, q: Any, k: Any, v: Any, comm,
                          ulysses_size: int, *, layout: str, sinks: Any = None,
                          return_lse: bool = False):
    """``hybrid_attention`` with its options as one value (what the
    bindings call)."""
    q, k, v, sinks = detached(q, k, v, sinks)
    method, wire = options.method, options.wire
    call = prepare(comm, "hybrid_attention", q, k, v, options, layout=layout, sinks=sinks,
                   check=lambda: (_check(q, comm.size, ulysses_size, method),
                                  check_wire(wire, q)),
                   ulysses_size=ulysses_size)
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh = seq_to_head_many([q, k, v], group, wire=wire)
    out, lse = ring_forward(call.over_groups(ulysses_size), qh, kh, vh, ring, method,
                            heads_here(sinks, group))
    heads = q.shape[2]
    result = head_to_seq(out, group, heads, wire=wire)
    return (result, lse_to_seq(lse, group, heads)) if return_lse else result


def hybrid_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                              ulysses_size: int, *, layout: str, causal: bool,
                              softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                              window: Any = None, mask: Any = None, method: str = "auto",
                              kernel: Optional[Kernel] = None, sinks: Any = None,
                              softcap: Optional[float] = None):
    """(dq, dk, dv) of ``hybrid_attention`` for this rank's shards; with
    ``sinks``, (dq, dk, dv, dsinks) as ``ring_attention_backward``'s."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return hybrid_attention_backward_with(options, dout, q, k, v, out, lse, comm, ulysses_size,
                                          layout=layout, sinks=sinks)


def hybrid_attention_backward_with(options: AttentionOptions, dout: Any, q: Any, k: Any,
                                   v: Any, out: Any, lse: Any, comm, ulysses_size: int, *,
                                   layout: str, sinks: Any = None):
    """``hybrid_attention_backward`` with its options as one value (the
    backward moves q's dtype: no ``wire``)."""
    dout, q, k, v, out, lse, sinks = detached(dout, q, k, v, out, lse, sinks)
    method = options.method
    call = prepare(comm, "hybrid_attention_backward", q, k, v, options, layout=layout,
                   extra=backward_extras(q, v, dout, out, lse), sinks=sinks,
                   check=lambda: _check(q, comm.size, ulysses_size, method),
                   ulysses_size=ulysses_size)
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh, dh, oh = seq_to_head_many([q, k, v, dout, out], group)
    dq, dk, dv = ring_backward(call.over_groups(ulysses_size), dh, qh, kh, vh, oh,
                               lse_to_heads(lse, group), ring, method)
    heads, kv_heads = q.shape[2], k.shape[2]
    grads = (head_to_seq(dq, group, heads), head_to_seq(dk, group, kv_heads, heads),
             head_to_seq(dv, group, kv_heads, heads))
    return with_sink_gradient(grads, dout, out, lse, sinks)
