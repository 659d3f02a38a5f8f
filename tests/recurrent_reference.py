"""The recurrent mixers one token at a time, in the inputs' dtype: the
independent references of the chunked, decomposed and sharded forms
(tests/test_recurrent_local.py, tests/mpi/test_recurrent_mixers.py)."""

import torch


def delta_rule_loop(q, k, v, g, beta, state, resets=(), l2norm=False):
    """The gated delta rule one token at a time: S <- exp(g) S; S += k (beta (v - S^T k))^T;
    o = S^T q / sqrt(dk); the state zeroed before each token in resets."""
    groups = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2) for x in (q, k))
    if l2norm:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    outs = []
    for t in range(q.shape[1]):
        if t in resets:
            state = torch.zeros_like(state)
        state = state * g[:, t].exp()[..., None, None]
        remembered = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def ssd_loop(x, dt, A, B, C, D, dt_bias, state, resets=()):
    """Mamba2 one token at a time: h <- exp(A dt) h + dt x B^T; y = h C + D x."""
    dt = torch.nn.functional.softplus(dt + dt_bias)
    heads = x.shape[2]
    B, C = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    ys = []
    for t in range(x.shape[1]):
        if t in resets:
            state = torch.zeros_like(state)
        state = (state * torch.exp(A * dt[:, t])[..., None, None]
                 + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(ys, dim=1), state
