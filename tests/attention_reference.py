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
