"""PyTorch bindings: outputs and gradients through autograd against the
unsharded computation (SDPA, a per-token loop), at any world size."""

import numpy as np
import pytest

import commlib
from commlib import ring

from conftest import all_ranks, raises_everywhere

torch = pytest.importorskip("torch")
ct = pytest.importorskip("commlib.bindings.torch")

SEQ, HEADS, DIM = 24, 12, 8


def attention_grads_match(comm, attend, layout, kv_heads, causal, dtype=torch.float32, tol=1e-5):
    gen = torch.Generator().manual_seed(kv_heads)
    full = [torch.randn(2, SEQ, h, DIM, generator=gen, dtype=torch.float64)
            for h in (HEADS, kv_heads, kv_heads, HEADS)]
    q, k, v = (ring.shard_sequence(t, comm, layout).to(dtype).requires_grad_()
               for t in full[:3])
    probe = ring.shard_sequence(full[3], comm, layout).to(dtype)
    out = attend(q, k, v)
    (out.float() * probe.float()).sum().backward()
    refs = [t.clone().requires_grad_() for t in full[:3]]
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in refs), is_causal=causal, enable_gqa=True).transpose(1, 2)
    (ref * full[3]).sum().backward()
    got_out = ring.unshard_sequence(out.detach(), comm, layout).double()
    ok = out.dtype == dtype and (got_out - ref.detach()).abs().max() < tol * 10
    for mine, theirs in zip((q, k, v), refs):
        grad = ring.unshard_sequence(mine.grad, comm, layout).double()
        ok = ok and (grad - theirs.grad).abs().max() < tol * 40
    return ok


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("kind", ["ring-zigzag", "ring-contiguous", "ulysses", "hybrid"])
def test_attention_gradients(comm, kind, kv_heads, causal):
    attend, layout = {
        "ring-zigzag": (lambda q, k, v: ct.ring_attention(q, k, v, comm, causal, "zigzag"),
                        "zigzag"),
        "ring-contiguous": (lambda q, k, v: ct.ring_attention(q, k, v, comm, causal),
                            "contiguous"),
        "ulysses": (lambda q, k, v: ct.ulysses_attention(q, k, v, comm, causal), "contiguous"),
        "hybrid": (lambda q, k, v: ct.hybrid_attention(q, k, v, comm, comm.size, causal),
                   "contiguous"),
    }[kind]
    assert all_ranks(attention_grads_match(comm, attend, layout, kv_heads, causal))


def test_bfloat16_attention(comm):
    attend = lambda q, k, v: ct.ring_attention(q, k, v, comm, True, "zigzag")  # noqa: E731
    assert all_ranks(attention_grads_match(comm, attend, "zigzag", 2 if HEADS % 2 == 0 else 1,
                                           True, dtype=torch.bfloat16, tol=2e-3))


@pytest.mark.parametrize("kv_heads", [HEADS, 1])
def test_relayouts_are_adjoint(comm, kv_heads):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, SEQ // comm.size, kv_heads, DIM, generator=gen, dtype=torch.float64)
    x.requires_grad_()
    heads_here = ct.seq_to_head(x, comm)
    y = torch.randn(heads_here.shape, generator=gen, dtype=torch.float64)
    (heads_here * y).sum().backward()
    left = comm.allreduce(np.array([(heads_here.detach() * y).sum().item()]))[0]
    right = comm.allreduce(np.array([(x.detach() * ct.head_to_seq(y, comm, kv_heads))
                                     .sum().item()]))[0]
    assert all_ranks(abs(left - right) < 1e-9 and torch.equal(
        x.grad, ct.head_to_seq(y, comm, kv_heads)))


@pytest.mark.parametrize("hierarchical, dtype", [(False, torch.float32), (True, torch.float32),
                                                 (False, torch.bfloat16)],
                         ids=["flat", "two-hop", "flat-bfloat16"])
def test_dispatch_combine_gradients_match_a_per_token_loop(comm, hierarchical, dtype):
    """Gradients to x, the gate's logits and the experts' weights, in the
    inputs' dtype, against autograd through a per-token loop in float64 on
    the same (rounded) values."""
    if hierarchical and comm.size % 2:
        pytest.skip("two-hop needs two emulated nodes")
    world = commlib.init(ranks_per_node=max(comm.size // 2, 1))
    try:
        experts_total, k, hidden = 4 * comm.size, 2, 5
        gen = torch.Generator().manual_seed(11)
        maps = torch.randn(experts_total, hidden, hidden, generator=gen).to(dtype)
        gen.manual_seed(20 + comm.rank)
        x = torch.randn(6 + comm.rank, hidden, generator=gen).to(dtype).requires_grad_()
        logits = torch.randn(x.shape[0], experts_total, generator=gen).requires_grad_()
        probe = torch.randn(x.shape[0], hidden, generator=gen, dtype=torch.float64)

        def gate(scores):
            weights, chosen = scores.softmax(-1).topk(k)
            return chosen, weights / weights.sum(-1, keepdim=True)

        chosen, weights = gate(logits)
        dispatcher = ct.Dispatcher(world, experts_total, hierarchical=hierarchical)
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        local = experts_total // comm.size
        owner = torch.repeat_interleave(torch.arange(local),
                                        torch.as_tensor(handle.tokens_per_expert))
        mine = maps.clone().requires_grad_()
        expert_y = torch.einsum("th,thg->tg", expert_x, mine[owner + comm.rank * local])
        y = dispatcher.combine(expert_y, handle)
        (y.double() * probe).sum().backward()

        x2, logits2, maps2 = (t.detach().double().requires_grad_() for t in (x, logits, maps))
        chosen2, weights2 = gate(logits2)
        y2 = sum(weights2[:, j, None] * torch.einsum("th,thg->tg", x2, maps2[chosen2[:, j]])
                 for j in range(k))
        (y2 * probe).sum().backward()
        maps_grad = comm.allreduce(maps2.grad.numpy())
        rows = slice(comm.rank * local, (comm.rank + 1) * local)
        tol = 1e-5 if dtype == torch.float32 else 5e-2

        def close(got, want):
            got, want = np.asarray(got.double()), np.asarray(want)
            return np.abs(got - want).max(initial=0) <= tol * max(1, np.abs(want).max())
        assert all_ranks(y.dtype == x.grad.dtype == mine.grad.dtype == dtype
                         and logits.grad.dtype == torch.float32
                         and chosen.equal(chosen2)  # same routing on the rounded values
                         and close(x.grad, x2.grad) and close(logits.grad, logits2.grad)
                         and close(mine.grad[rows], maps_grad[rows]))
    finally:
        world.free()


def test_float_expert_indices_are_refused_on_every_rank(comm):
    dispatcher = ct.Dispatcher(comm, 2 * comm.size)
    x = torch.randn(3, 4)
    experts = torch.zeros(3, 1, dtype=torch.int64)
    if comm.rank == 0:
        experts = experts.float().requires_grad_()
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: dispatcher.dispatch(x, experts, torch.ones(3, 1)),
                      match="experts must be integers")


def test_cpu_tensors_are_shared_not_copied():
    from commlib.arrays import unwrap

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert unwrap(t).data.__array_interface__["data"][0] == t.data_ptr()
