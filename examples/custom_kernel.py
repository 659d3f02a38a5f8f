# mpiexec -n 2 python examples/custom_kernel.py
"""A user block kernel (``commlib.kernels.Kernel``) for Ring Attention:
plain PyTorch math, forward and backward, against the built-in kernel
(PyTorch's fused SDPA ops). docs/ring.md, "Block kernels and kernel=",
states the contract this follows."""

import torch

import commlib
from commlib import ring
from commlib.kernels import Kernel, kernel_for

calls = {"forward": 0, "backward": 0}


def _scores(q, k, causal, scale):
    """[b, h, sq, sk] float32 scores; k and v may have fewer heads (GQA)."""
    group = q.shape[2] // k.shape[2]                  # query head i uses kv head i // group
    qh = q.transpose(1, 2).float()
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2).float()
    scores = qh @ kh.transpose(-1, -2) * scale
    if causal:                                        # aligned diagonal: sq == sk
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, -torch.inf)
    return scores, group


def forward(q, k, v, causal, scale):
    """(out [b, sq, h, d] in q's dtype, lse [b, h, sq] float32)."""
    calls["forward"] += 1
    scores, group = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2).float()
    out = torch.exp(scores - lse[..., None]) @ vh
    return out.transpose(1, 2).to(q.dtype), lse


def backward(dout, q, k, v, out, lse, causal, scale):
    """(dq, dk, dv) of this block, given the *global* out and lse."""
    calls["backward"] += 1
    scores, group = _scores(q, k, causal, scale)
    probs = torch.exp(scores - lse[..., None])        # this block's columns of the full softmax
    do = dout.transpose(1, 2).float()
    vh = v.repeat_interleave(group, dim=2).transpose(1, 2).float()
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)[..., None]  # rowsum(dO * O)
    ds = probs * (do @ vh.transpose(-1, -2) - delta) * scale
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2).float()
    dq = ds @ kh
    dk = ds.transpose(-1, -2) @ q.transpose(1, 2).float()
    dv = probs.transpose(-1, -2) @ do

    def per_kv_head(x):                               # [b, h, sk, d] -> [b, sk, hk, d]
        b, h, s, d = x.shape
        return x.reshape(b, h // group, group, s, d).sum(2).transpose(1, 2)
    return (dq.transpose(1, 2).to(q.dtype), per_kv_head(dk).to(k.dtype),
            per_kv_head(dv).to(v.dtype))


MATH = Kernel(forward, backward, name="torch-math")

comm = commlib.init()
torch.manual_seed(0)                                  # the same global tensors on every rank
q, dout = (torch.randn(1, 64, 4, 16) for _ in range(2))
k, v = (torch.randn(1, 64, 2, 16) for _ in range(2))  # GQA: 4 query heads, 2 kv heads
q, k, v, dout = (ring.shard_sequence(x, comm, layout="zigzag") for x in (q, k, v, dout))
opts = dict(causal=True, layout="zigzag")
results = {}
for kernel in (MATH, None):                           # None: the built-in choice
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, kernel=kernel, **opts)
    grads = ring.ring_attention_backward(dout, q, k, v, out, lse, comm, kernel=kernel, **opts)
    results[kernel.name if kernel else kernel_for(q).name] = (out, lse, *grads)
diffs = ", ".join(f"{name} {(a - b).abs().max():.1e}" for name, a, b in
                  zip(("out", "lse", "dq", "dk", "dv"), *results.values()))
print(f"rank {comm.rank}: {MATH.name} ran {calls['forward']} forward and {calls['backward']} "
      f"backward block calls; max |{' - '.join(results)}|: {diffs}", flush=True)
