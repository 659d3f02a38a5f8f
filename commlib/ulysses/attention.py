"""Ulysses attention: swap the sequence-sharded layout for a head-sharded
one (one all-to-all for q, k and v together), attend over the whole
sequence for this rank's heads with the local block kernel, swap back.
The backward pass is the mirror image."""

from __future__ import annotations

from typing import Any, Optional

from ..arrays import Native, unwrap
from ..attention_inputs import backward_extras, check_qkv, problem_of, scale_of, settings
from ..ring import kernel as _kernel
from ..ring.attention import AttnFn
from .relayout import check_heads, head_to_seq, kv_heads_for, seq_to_head_many


def check_inputs(q: Native, k: Native, v: Native, degree: int, extra=()) -> None:
    """Raise ValueError if these shards cannot run Ulysses at ``degree``."""
    check_qkv(q, k, v, extra)
    check_heads(q.data.shape[2], degree)
    kv_heads_for(0, k.data.shape[2], degree)


def lse_to_heads(lse, comm):
    """[b, h, s/P] -> [b, h/P, s]."""
    return comm.alltoall(lse, split_axis=1, concat_axis=2)


def lse_to_seq(lse, comm):
    """[b, h/P, s] -> [b, h, s/P]."""
    return comm.alltoall(lse, split_axis=2, concat_axis=1)


def ulysses_attention(q: Any, k: Any, v: Any, comm, causal: bool = False,
                      softmax_scale: Optional[float] = None, return_lse: bool = False,
                      attn_fn: Optional[AttnFn] = None):
    """Attention over the whole sequence for contiguous sequence shards
    q [b, s/P, h, d], k/v [b, s/P, hk, d]; h must divide by P, and hk be a
    multiple of P or divide it. Returns out [b, s/P, h, d] (q's dtype and
    framework) and, with ``return_lse``, lse [b, h, s/P] float32."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    scale = scale_of(nq, softmax_scale)
    comm.agree("ulysses_attention", tuple(nq.data.shape), tuple(nk.data.shape), nq.dtype.name,
               *settings(("causal", causal), ("scale", scale)),
               problem=problem_of(check_inputs, nq, nk, nv, comm.size))
    qh, kh, vh = seq_to_head_many([nq.data, nk.data, nv.data], comm)
    out, lse = (attn_fn or _kernel.attention_forward)(qh, kh, vh, causal, scale)
    result = nq.wrap(unwrap(head_to_seq(out.astype(nq.data.dtype), comm)).data)
    if not return_lse:
        return result
    return result, nq.wrap(unwrap(lse_to_seq(lse.astype("float32"), comm)).data)


def ulysses_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                               causal: bool = False, softmax_scale: Optional[float] = None):
    """(dq, dk, dv) of ``ulysses_attention`` for this rank's shards."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    nd, no, nl = unwrap(dout), unwrap(out), unwrap(lse)
    scale = scale_of(nq, softmax_scale)
    comm.agree("ulysses_attention_backward", tuple(nq.data.shape), tuple(nk.data.shape),
               nq.dtype.name, *settings(("causal", causal), ("scale", scale)),
               problem=problem_of(check_inputs, nq, nk, nv, comm.size,
                                  backward_extras(nq, nd, no, nl)))
    qh, kh, vh, dh, oh = seq_to_head_many(
        [nq.data, nk.data, nv.data, nd.data, no.data], comm)
    lse_h = lse_to_heads(nl.data, comm)
    dq, dk, dv = _kernel.attention_backward(dh, qh, kh, vh, oh, lse_h, causal, scale)
    kv_heads = nk.data.shape[2]
    return (nq.wrap(unwrap(head_to_seq(dq, comm)).data.astype(nq.data.dtype)),
            nk.wrap(unwrap(head_to_seq(dk, comm, kv_heads)).data.astype(nk.data.dtype)),
            nv.wrap(unwrap(head_to_seq(dv, comm, kv_heads)).data.astype(nv.data.dtype)))
