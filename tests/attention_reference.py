"""Full (unsharded) attention in NumPy float64: the independent reference
for the sequence-parallel attention tests."""

import numpy as np


def reference_attention(q, k, v, causal, scale=None):
    """q [b, s, h, d], k/v [b, s, hk, d] -> (out [b, s, h, d], lse [b, h, s]),
    float64, query head i using kv head i // (h // hk)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = scale if scale is not None else 1.0 / np.sqrt(q.shape[-1])
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = q.shape[1]
        scores = np.where(np.triu(np.ones((s, s), bool), 1), -np.inf, scores)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", weights / total, v)
    return out, (top + np.log(total))[..., 0]


def torch_reference(q, k, v, dout, causal, scale=None):
    """(out, dq, dk, dv) of torch's scaled_dot_product_attention on the
    unsharded sequence, float64, through autograd: the independent
    reference for outputs and gradients."""
    import torch

    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64)).transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                           enable_gqa=True, scale=scale)
    out.backward(torch.tensor(np.asarray(dout, np.float64)).transpose(1, 2))
    return [t.detach().transpose(1, 2).numpy() for t in (out, tq.grad, tk.grad, tv.grad)]


def document_mask(length, cu_seqlens=None, causal=False, window=None):
    """The explicit [s, s] mask (True = visible) of packed documents,
    causality and a (left, right) sliding window, written from the
    definition: same document, and key position within reach."""
    offsets = np.asarray(cu_seqlens if cu_seqlens is not None else [0, length])
    doc = np.searchsorted(offsets, np.arange(length), side="right") - 1
    position = np.arange(length) - offsets[doc]
    gap = position[:, None] - position[None, :]
    visible = doc[:, None] == doc[None, :]
    if causal:
        visible &= gap >= 0
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            visible &= gap <= left
        if right is not None and right >= 0:
            visible &= gap >= -right
    return visible


def position_mask(q_positions, k_positions, causal, window=None):
    """The [t, n] mask (True = visible) of queries at ``q_positions`` over
    keys at ``k_positions``: key r seen from p when r <= p (``causal``) and
    inside ``window`` = (left, right), by global position."""
    gap = np.asarray(q_positions)[:, None] - np.asarray(k_positions)[None, :]
    mask = gap >= 0 if causal else np.ones(gap.shape, bool)
    if window is not None:
        mask &= (gap <= window[0]) & (gap >= -window[1])
    return mask


def masked_torch_reference(q, k, v, dout, mask, scale=None):
    """``torch_reference`` with an explicit boolean mask [s, s]."""
    import torch

    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64)).transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.tensor(mask), enable_gqa=True, scale=scale)
    out.backward(torch.tensor(np.asarray(dout, np.float64)).transpose(1, 2))
    return [t.detach().transpose(1, 2).numpy() for t in (out, tq.grad, tk.grad, tv.grad)]


def relative_error(got, want) -> float:
    """max |got - want| over max(1, max |want|), in float64; inf where the
    shapes differ or ``got`` holds a NaN: what the tolerances bound."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or np.isnan(got).any():
        return float("inf")
    return float(np.abs(got - want).max(initial=0.0) / max(1.0, np.abs(want).max(initial=0.0)))


def sink_reference(q, k, v, dout, mask, sinks, scale=None):
    """(out, dq, dk, dv, dsinks) of attention with sinks on the unsharded
    sequence, float64, through autograd: gpt-oss's eager softmax, written
    out (scores and one sink column per head, softmax, the sink's column
    dropped), under the boolean ``mask`` [s_q, s_k] (True = visible)."""
    return eager_reference(q, k, v, dout, mask, sinks=sinks, scale=scale)


def eager_reference(q, k, v, dout, mask, sinks=None, softcap=None, scale=None):
    """(out, dq, dk, dv, and dsinks with ``sinks``) of attention on the
    unsharded sequence, float64, through autograd, written out step by
    step: scores, scale, Gemma2's cap (cap * tanh(s / cap), with
    ``softcap``), the boolean ``mask`` [s_q, s_k] (True = visible), one
    sink column per head (with ``sinks``), softmax, the sink's column
    dropped, the values."""
    import torch

    tq, tk, tv = (torch.tensor(np.asarray(x, np.float64)).transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    group = tq.shape[1] // tk.shape[1]
    keys, values = (x.repeat_interleave(group, dim=1) for x in (tk, tv))
    scale = scale if scale is not None else 1.0 / np.sqrt(tq.shape[-1])
    scores = (tq @ keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~torch.tensor(np.asarray(mask, bool)), float("-inf"))
    b, h, s, _ = scores.shape
    learned = []
    if sinks is not None:
        learned = [torch.tensor(np.asarray(sinks, np.float64)).requires_grad_()]
        column = learned[0].reshape(1, h, 1, 1).expand(b, h, s, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs @ values
    out.backward(torch.tensor(np.asarray(dout, np.float64)).transpose(1, 2))
    return ([t.detach().transpose(1, 2).numpy() for t in (out, tq.grad, tk.grad, tv.grad)]
            + [x.grad.numpy() for x in learned])
