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

from ..arrays import unwrap
from ..ring.attention import ring_attention, ring_attention_backward
from ..attention_inputs import backward_extras, problem_of, scale_of, settings
from ..ulysses.attention import check_inputs, lse_to_heads, lse_to_seq
from ..ulysses.relayout import divisors, head_to_seq, seq_to_head_many

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


def _check(q, k, v, size, ulysses_size, extra=()):
    check_degree(size, ulysses_size)
    check_inputs(q, k, v, ulysses_size, extra)


def hybrid_attention(q: Any, k: Any, v: Any, comm, ulysses_size: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, return_lse: bool = False):
    """Attention over the whole sequence for contiguous shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d]: Ulysses of degree ``ulysses_size``
    inside groups, a ring of P / ulysses_size across them."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    scale = scale_of(nq, softmax_scale)
    comm.agree("hybrid_attention", tuple(nq.data.shape), tuple(nk.data.shape), nq.dtype.name,
               *settings(("ulysses_size", ulysses_size), ("causal", causal), ("scale", scale)),
               problem=problem_of(_check, nq, nk, nv, comm.size, ulysses_size))
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh = seq_to_head_many([nq.data, nk.data, nv.data], group)
    out, lse = ring_attention(qh, kh, vh, ring, causal=causal, layout="contiguous",
                              softmax_scale=scale, return_lse=True)
    result = nq.wrap(unwrap(head_to_seq(out, group)).data)
    if not return_lse:
        return result
    return result, nq.wrap(unwrap(lse_to_seq(lse, group)).data)


def hybrid_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                              ulysses_size: int, causal: bool = False,
                              softmax_scale: Optional[float] = None):
    """(dq, dk, dv) of ``hybrid_attention`` for this rank's shards."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    nd, no, nl = unwrap(dout), unwrap(out), unwrap(lse)
    scale = scale_of(nq, softmax_scale)
    comm.agree("hybrid_attention_backward", tuple(nq.data.shape), tuple(nk.data.shape),
               nq.dtype.name,
               *settings(("ulysses_size", ulysses_size), ("causal", causal), ("scale", scale)),
               problem=problem_of(_check, nq, nk, nv, comm.size, ulysses_size,
                                  backward_extras(nq, nd, no, nl)))
    group, ring = groups(comm, ulysses_size)
    qh, kh, vh, dh, oh = seq_to_head_many([nq.data, nk.data, nv.data, nd.data, no.data], group)
    dq, dk, dv = ring_attention_backward(dh, qh, kh, vh, oh, lse_to_heads(nl.data, group), ring,
                                         causal=causal, layout="contiguous",
                                         softmax_scale=scale)
    kv_heads = nk.data.shape[2]
    return (nq.wrap(unwrap(head_to_seq(dq, group)).data),
            nk.wrap(unwrap(head_to_seq(dk, group, kv_heads)).data),
            nv.wrap(unwrap(head_to_seq(dv, group, kv_heads)).data))
