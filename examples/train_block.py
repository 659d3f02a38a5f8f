"""A transformer block trained with context parallelism (Ring, Ulysses or
their hybrid) and an expert-parallel MoE feed-forward (top-2 over 4 experts),
against the same block trained on one process on the unsharded sequence.

    mpiexec -n 2 python examples/train_block.py ring
    mpiexec -n 4 python examples/train_block.py ulysses
    mpiexec -n 4 python examples/train_block.py hybrid     # Ulysses 2 x Ring 2

Every rank holds every parameter; the sharded run sums the gradients over
ranks (an expert's only come from its owner) and takes the same SGD step, so
both runs must follow the same loss curve to float32 precision.
"""

import click
import numpy as np
import torch

import commlib
from commlib import ring
from commlib.bindings import torch as ct

SEQ, MODEL, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOPK = 32, 16, 4, 2, 4, 4, 2
STEPS, LEARNING_RATE = 20, 0.1


def initial_parameters():
    gen = torch.Generator().manual_seed(0)

    def param(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()
    return {"wq": param(MODEL, HEADS * HEAD_DIM, scale=0.3),
            "wk": param(MODEL, KV_HEADS * HEAD_DIM, scale=0.3),
            "wv": param(MODEL, KV_HEADS * HEAD_DIM, scale=0.3),
            "wo": param(HEADS * HEAD_DIM, MODEL, scale=0.3),
            "router": param(MODEL, EXPERTS, scale=0.5),
            "experts": param(EXPERTS, MODEL, MODEL, scale=0.3)}


def batch():
    return torch.randn(1, SEQ, MODEL, generator=torch.Generator().manual_seed(1))


def gate(tokens, p):
    weights, chosen = (tokens @ p["router"]).softmax(-1).topk(TOPK)
    return chosen, weights / weights.sum(-1, keepdim=True)


def block(x, p, attend, moe):
    """x [1, s, MODEL] -> loss contribution: attention, then MoE, residuals."""
    s = x.shape[1]
    q = (x @ p["wq"]).view(1, s, HEADS, HEAD_DIM)
    k = (x @ p["wk"]).view(1, s, KV_HEADS, HEAD_DIM)
    v = (x @ p["wv"]).view(1, s, KV_HEADS, HEAD_DIM)
    h = x + attend(q, k, v).reshape(1, s, HEADS * HEAD_DIM) @ p["wo"]
    tokens = h.reshape(s, MODEL)
    out = tokens + moe(tokens, p)
    return (out ** 2).sum() / (SEQ * MODEL)


def full_attention(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)


def dense_moe(tokens, p):
    chosen, weights = gate(tokens, p)
    return sum(weights[:, j, None] * torch.tanh(
        torch.einsum("tm,tmn->tn", tokens, p["experts"][chosen[:, j]])) for j in range(TOPK))


def train_single():
    p, x, losses = initial_parameters(), batch(), []
    for _ in range(STEPS):
        loss = block(x, p, full_attention, dense_moe)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for t in p.values():
                t -= LEARNING_RATE * t.grad
                t.grad = None
    return losses, {name: t.detach() for name, t in p.items()}


def attention_of(name, comm):
    """(the sequence layout, the attention) of a context-parallel scheme;
    the hybrid runs Ulysses over pairs of ranks where the world size is even."""
    ulysses_size = 2 if comm.size % 2 == 0 else 1
    return {"ring": ("zigzag", lambda q, k, v: ct.ring_attention(
                q, k, v, comm, layout="zigzag", causal=True)),
            "ulysses": ("contiguous", lambda q, k, v: ct.ulysses_attention(
                q, k, v, comm, layout="contiguous", causal=True)),
            "hybrid": ("contiguous", lambda q, k, v: ct.hybrid_attention(
                q, k, v, comm, ulysses_size, layout="contiguous", causal=True))}[name]


def train_sharded(comm, attention):
    layout, attend = attention_of(attention, comm)
    dispatcher = ct.Dispatcher(comm, EXPERTS)
    local = EXPERTS // comm.size

    def expert_parallel_moe(tokens, p):
        chosen, weights = gate(tokens, p)
        expert_x, handle = dispatcher.dispatch(tokens, chosen, weights)
        owner = torch.repeat_interleave(torch.arange(local),
                                        torch.as_tensor(handle.tokens_per_expert))
        expert_y = torch.tanh(torch.einsum("tm,tmn->tn", expert_x,
                                           p["experts"][owner + comm.rank * local]))
        return dispatcher.combine(expert_y, handle)

    p, losses = initial_parameters(), []
    x = ring.shard_sequence(batch(), comm, layout=layout)
    for _ in range(STEPS):
        loss = block(x, p, attend, expert_parallel_moe)
        loss.backward()
        losses.append(float(comm.allreduce(np.array([loss.item()]))[0]))
        with torch.no_grad():
            for t in p.values():
                t -= LEARNING_RATE * torch.as_tensor(comm.allreduce(t.grad.numpy()))
                t.grad = None
    return losses, {name: t.detach() for name, t in p.items()}


@click.command()
@click.argument("attention", type=click.Choice(["ring", "ulysses", "hybrid"]), default="ring")
def main(attention):
    """Train the block sharded with ATTENTION and on one process; compare."""
    comm = commlib.init()
    losses, params = train_sharded(comm, attention)
    reference, reference_params = train_single()
    worst = max((params[n] - reference_params[n]).abs().max().item() for n in params)
    if comm.rank == 0:
        print(f"{attention} on {comm.size} ranks, {STEPS} steps")
        print("loss sharded:", " ".join(f"{x:.5f}" for x in losses[::4]), f"... {losses[-1]:.5f}")
        print("loss single: ", " ".join(f"{x:.5f}" for x in reference[::4]),
              f"... {reference[-1]:.5f}")
        print(f"max |loss difference| {max(abs(a - b) for a, b in zip(losses, reference)):.2e}, "
              f"max |parameter difference| {worst:.2e}")
    comm.free()


if __name__ == "__main__":
    main()
