"""Ulysses attention: swap the sequence-sharded layout for a head-sharded
one (one all-to-all for q, k and v together), attend over the whole
sequence for this rank's heads with the block kernel of the arrays'
framework (``commlib.kernels``), swap back. The backward pass is the mirror
image. Everything runs in the caller's framework, device and dtype.

Packed documents (``cu_seqlens``), padding and a sliding ``window`` decide
which blocks of the whole sequence the kernel runs on
(``commlib.visibility``): one causal call for a plain sequence."""

from __future__ import annotations

from typing import Any, Optional

from ..attention_inputs import backward_extras, check_qkv, prepare, scale_of
from ..kernels import Kernel, kernel_for
from ..kernels.blockwise import attend, attend_backward, finish
from ..namespace import detached, namespace
from ..visibility import blocks
from .relayout import check_heads, head_to_seq, lse_to_heads, lse_to_seq, seq_to_head_many


def check_inputs(q: Any, k: Any, v: Any, degree: int, extra=()) -> None:
    """Raise ValueError if these shards cannot run Ulysses at ``degree``."""
    check_qkv(q, k, v, extra)
    check_heads(q.shape[2], degree)


def ulysses_attention(q: Any, k: Any, v: Any, comm, causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      cu_seqlens: Any = None, window: Any = None,
                      kernel: Optional[Kernel] = None):
    """Attention over the whole sequence for contiguous sequence shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d] with h >= P (heads split unevenly
    where P does not divide them: ``relayout``); ``cu_seqlens`` and
    ``window`` as ``ring_attention``'s. Returns out [b, s/P, h, d] (q's
    framework, device and dtype) and, with ``return_lse``, lse [b, h, s/P]
    float32."""
    q, k, v = detached(q, k, v)
    scale = scale_of(q, softmax_scale)
    packing, (lo, hi) = prepare(comm, "ulysses_attention", q, k,
                                lambda: check_inputs(q, k, v, comm.size), "contiguous", causal,
                                cu_seqlens, window, scale=scale)
    qh, kh, vh = seq_to_head_many([q, k, v], comm)
    whole = packing.all_spans()
    out, lse = finish(attend(kernel or kernel_for(q), qh, kh, vh, blocks(whole, whole, lo, hi),
                             scale), qh)
    heads = q.shape[2]
    result = head_to_seq(out, comm, heads)  # finish gave it q's dtype
    if not return_lse:
        return result
    return result, lse_to_seq(lse, comm, heads)


def ulysses_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               cu_seqlens: Any = None, window: Any = None,
                               kernel: Optional[Kernel] = None):
    """(dq, dk, dv) of ``ulysses_attention`` for this rank's shards, in q's
    framework, device and dtype."""
    dout, q, k, v, out, lse = detached(dout, q, k, v, out, lse)
    scale = scale_of(q, softmax_scale)
    extra = backward_extras(q, dout, out, lse)
    packing, (lo, hi) = prepare(comm, "ulysses_attention_backward", q, k,
                                lambda: check_inputs(q, k, v, comm.size, extra), "contiguous",
                                causal, cu_seqlens, window, scale=scale)
    xp = namespace(q)
    qh, kh, vh, dh, oh = seq_to_head_many([q, k, v, dout, out], comm)
    whole = packing.all_spans()
    dq, dkv = attend_backward(kernel or kernel_for(q), dh, qh, kh, vh, oh,
                              lse_to_heads(lse, comm), blocks(whole, whole, lo, hi), scale)
    heads, kv_heads = q.shape[2], k.shape[2]
    return (head_to_seq(xp.astype(dq, q.dtype), comm, heads),
            head_to_seq(xp.astype(dkv[0], k.dtype), comm, kv_heads, heads),
            head_to_seq(xp.astype(dkv[1], v.dtype), comm, kv_heads, heads))
