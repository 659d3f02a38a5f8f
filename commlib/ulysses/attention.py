"""Ulysses attention: swap the sequence-sharded layout for a head-sharded
one (one all-to-all for q, k and v together), attend over the whole
sequence for this rank's heads with the block kernel of the arrays'
framework (``commlib.kernels``), swap back. The backward pass is the mirror
image. Everything runs in the caller's framework, device and dtype."""

from __future__ import annotations

from typing import Any, Optional

from ..attention_inputs import agree_on_inputs, backward_extras, check_qkv, problem_of, scale_of
from ..kernels import Kernel, kernel_for
from ..namespace import detached, namespace
from .relayout import check_heads, head_to_seq, kv_heads_for, seq_to_head_many


def check_inputs(q: Any, k: Any, v: Any, degree: int, extra=()) -> None:
    """Raise ValueError if these shards cannot run Ulysses at ``degree``."""
    check_qkv(q, k, v, extra)
    check_heads(q.shape[2], degree)
    kv_heads_for(0, k.shape[2], degree)


def lse_to_heads(lse, comm):
    """[b, h, s/P] -> [b, h/P, s]."""
    return comm.alltoall(lse, split_axis=1, concat_axis=2)


def lse_to_seq(lse, comm):
    """[b, h/P, s] -> [b, h, s/P]."""
    return comm.alltoall(lse, split_axis=2, concat_axis=1)


def ulysses_attention(q: Any, k: Any, v: Any, comm, causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      kernel: Optional[Kernel] = None):
    """Attention over the whole sequence for contiguous sequence shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d]; h must divide by P, and hk be a
    multiple of P or divide it. Returns out [b, s/P, h, d] (q's framework,
    device and dtype) and, with ``return_lse``, lse [b, h, s/P] float32."""
    q, k, v = detached(q, k, v)
    scale = scale_of(q, softmax_scale)
    agree_on_inputs(comm, "ulysses_attention", q, k,
                    problem_of(check_inputs, q, k, v, comm.size), causal=causal, scale=scale)
    xp = namespace(q)
    qh, kh, vh = seq_to_head_many([q, k, v], comm)
    out, lse = (kernel or kernel_for(q)).forward(qh, kh, vh, causal, scale)
    result = head_to_seq(xp.astype(out, q.dtype), comm)
    if not return_lse:
        return result
    return result, lse_to_seq(xp.astype(lse, xp.float32, copy=False), comm)


def ulysses_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               kernel: Optional[Kernel] = None):
    """(dq, dk, dv) of ``ulysses_attention`` for this rank's shards, in q's
    framework, device and dtype."""
    dout, q, k, v, out, lse = detached(dout, q, k, v, out, lse)
    scale = scale_of(q, softmax_scale)
    agree_on_inputs(comm, "ulysses_attention_backward", q, k,
                    problem_of(check_inputs, q, k, v, comm.size,
                               backward_extras(q, dout, out, lse)),
                    causal=causal, scale=scale)
    xp = namespace(q)
    qh, kh, vh, dh, oh = seq_to_head_many([q, k, v, dout, out], comm)
    dq, dk, dv = (kernel or kernel_for(q)).backward(dh, qh, kh, vh, oh, lse_to_heads(lse, comm),
                                                   causal, scale)
    kv_heads = k.shape[2]
    return (head_to_seq(xp.astype(dq, q.dtype), comm),
            head_to_seq(xp.astype(dk, k.dtype), comm, kv_heads),
            head_to_seq(xp.astype(dv, v.dtype), comm, kv_heads))
