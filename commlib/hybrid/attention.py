"""Ulysses x Ring (USP): Ulysses inside groups of ``ulysses_size``
consecutive ranks, Ring Attention across the groups.

The input is sharded contiguously by world rank (rank w holds chunk w of P).
Inside group g (ranks g*u .. g*u+u-1) seq_to_head gathers the group's span
of the sequence (chunks g*u .. g*u+u-1, contiguous: span g of R = P/u) for
u-th of the heads; the ranks at the same position of every group form a
ring of R ranks, in which rank g holds span g: Ring Attention with the
contiguous layout. Then head_to_seq inside the group.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Tuple

from ..attention_inputs import backward_extras, prepare, scale_of
from ..kernels import Kernel
from ..namespace import detached
from ..ring.attention import check_method, ring_attention, ring_attention_backward
from ..ulysses.attention import check_inputs
from ..ulysses.relayout import divisors, head_to_seq, lse_to_heads, lse_to_seq, seq_to_head_many

_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_degree(size: int, ulysses_size: int) -> None:
    if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) \
            or ulysses_size < 1 or size % ulysses_size:
        raise ValueError(f"ulysses_size={ulysses_size!r} must divide the world size {size}; "
                         f"use one of {divisors(size)}")


def groups(comm, ulysses_size: int) -> Tuple[Any, Any]:
    """(Ulysses group, ring) sub-communicators of ``comm``, made once per
    communicator and degree (collective the first time)."""
    per_comm = _groups.setdefault(comm, {})
    if ulysses_size not in per_comm:
        group = comm.split(comm.rank // ulysses_size, key=comm.rank)
        across = comm.split(comm.rank % ulysses_size, key=comm.rank)
        per_comm[ulysses_size] = (group, across)
    return per_comm[ulysses_size]


def _check(q, k, v, size, ulysses_size, method, extra=()):
    check_degree(size, ulysses_size)
    check_inputs(q, k, v, ulysses_size, extra)
    check_method(method)


def hybrid_attention(q: Any, k: Any, v: Any, comm, ulysses_size: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, return_lse: bool = False,
                     cu_seqlens: Any = None, window: Any = None, method: str = "ring",
                     kernel: Optional[Kernel] = None):
    """Attention over the whole sequence for contiguous shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d]: Ulysses of degree ``ulysses_size``
    inside groups, a ring (``method`` "ring" or "allgather") of
    P / ulysses_size across them; ``cu_seqlens`` and ``window`` as
    ``ring_attention``'s. In q's framework, device and dtype."""
    q, k, v = detached(q, k, v)
    scale = scale_of(q, softmax_scale)
    prepare(comm, "hybrid_attention", q, k,
            lambda: _check(q, k, v, comm.size, ulysses_size, method), "contiguous", causal,
            cu_seqlens, window, ulysses_size=ulysses_size, method=method, scale=scale)
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh = seq_to_head_many([q, k, v], group)
    out, lse = ring_attention(qh, kh, vh, ring, causal=causal, layout="contiguous",
                              softmax_scale=scale, return_lse=True, cu_seqlens=cu_seqlens,
                              window=window, method=method, kernel=kernel)
    heads = q.shape[2]
    result = head_to_seq(out, group, heads)
    return (result, lse_to_seq(lse, group, heads)) if return_lse else result


def hybrid_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                              ulysses_size: int, causal: bool = False,
                              softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                              window: Any = None, method: str = "ring",
                              kernel: Optional[Kernel] = None):
    """(dq, dk, dv) of ``hybrid_attention`` for this rank's shards."""
    dout, q, k, v, out, lse = detached(dout, q, k, v, out, lse)
    scale = scale_of(q, softmax_scale)
    extra = backward_extras(q, dout, out, lse)
    prepare(comm, "hybrid_attention_backward", q, k,
            lambda: _check(q, k, v, comm.size, ulysses_size, method, extra), "contiguous",
            causal, cu_seqlens, window, ulysses_size=ulysses_size, method=method, scale=scale)
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh, dh, oh = seq_to_head_many([q, k, v, dout, out], group)
    dq, dk, dv = ring_attention_backward(dh, qh, kh, vh, oh, lse_to_heads(lse, group), ring,
                                         causal=causal, layout="contiguous",
                                         softmax_scale=scale, cu_seqlens=cu_seqlens,
                                         window=window, method=method, kernel=kernel)
    heads, kv_heads = q.shape[2], k.shape[2]
    return (head_to_seq(dq, group, heads), head_to_seq(dk, group, kv_heads, heads),
            head_to_seq(dv, group, kv_heads, heads))
