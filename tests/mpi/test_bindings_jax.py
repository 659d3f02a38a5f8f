"""JAX bindings under jit and grad against jax.nn.dot_product_attention on
the unsharded sequence."""

import numpy as np
import pytest

from commlib import ring

from conftest import all_ranks

jax = pytest.importorskip("jax")
jnp = jax.numpy
cj = pytest.importorskip("commlib.bindings.jax")

SEQ, HEADS, DIM = 24, 12, 8


def reference(q, k, v, causal):
    group = q.shape[2] // k.shape[2]
    return jax.nn.dot_product_attention(q, jnp.repeat(k, group, axis=2),
                                        jnp.repeat(v, group, axis=2), is_causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [HEADS, 1])
@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_jit_and_grad_match_unsharded_attention(comm, kind, kv_heads, causal):
    rng = np.random.default_rng(kv_heads)
    full = [rng.standard_normal((1, SEQ, h, DIM)).astype(np.float32)
            for h in (HEADS, kv_heads, kv_heads, HEADS)]
    layout = "zigzag" if kind == "ring" else "contiguous"
    q, k, v, probe = (jnp.asarray(ring.shard_sequence(x, comm, layout)) for x in full)
    if kind == "ring":
        attend = lambda q, k, v: cj.ring_attention(q, k, v, comm, causal, layout)  # noqa: E731
    else:
        attend = lambda q, k, v: cj.ulysses_attention(q, k, v, comm, causal)  # noqa: E731
    out = jax.jit(attend)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: (attend(q, k, v) * probe).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    want = reference(*full[:3], causal)
    want_grads = jax.grad(lambda q, k, v: (reference(q, k, v, causal) * full[3]).sum(),
                          argnums=(0, 1, 2))(*full[:3])
    ok = isinstance(out, jax.Array) and np.allclose(
        ring.unshard_sequence(np.asarray(out), comm, layout), want, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        ok = ok and np.allclose(ring.unshard_sequence(np.asarray(got), comm, layout),
                                expected, atol=1e-4)
    assert all_ranks(ok)


def test_shapes_that_differ_between_ranks_fail_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    local = 6 if comm.rank else 8
    q = jnp.ones((1, local, HEADS, DIM), jnp.float32)
    try:
        jax.jit(lambda q: cj.ring_attention(q, q, q, comm))(q).block_until_ready()
        message = ""
    except Exception as error:  # the callback's CollectiveMismatchError, wrapped by XLA
        message = str(error)
    assert all_ranks("ring_attention" in message and "different arguments" in message)


def _moe_problem(comm, tokens=8, hidden=5, k=2):
    experts = 4 * comm.size
    rng = np.random.default_rng(comm.rank)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32))
    logits = jnp.asarray(rng.standard_normal((tokens, experts)).astype(np.float32))
    maps = jnp.asarray(np.random.default_rng(9).standard_normal((experts, hidden, hidden))
                       .astype(np.float32))
    probe = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32))
    return experts, k, x, logits, maps, probe


def _gate(logits, k):
    weights, chosen = jax.lax.top_k(jax.nn.softmax(logits), k)
    return chosen, weights / weights.sum(-1, keepdims=True)


def test_moe_dispatch_combine_under_jit_and_grad(comm):
    experts, k, x, logits, maps, probe = _moe_problem(comm)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=float(experts))  # no drops
    local = experts // comm.size
    mine = slice(comm.rank * local, (comm.rank + 1) * local)

    def loss(x, logits, maps):
        chosen, weights = _gate(logits, k)
        expert_x, key = dispatcher.dispatch(x, chosen, weights)
        expert_y = jnp.einsum("lsh,lhg->lsg", expert_x, maps[mine])
        return (dispatcher.combine(expert_y, weights, key) * probe).sum()

    def reference(x, logits, maps):
        chosen, weights = _gate(logits, k)
        y = sum(weights[:, j, None] * jnp.einsum("th,thg->tg", x, maps[chosen[:, j]])
                for j in range(k))
        return (y * probe).sum()

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, logits, maps)
    want = jax.grad(reference, argnums=(0, 1, 2))(x, logits, maps)
    maps_grad = comm.allreduce(np.asarray(want[2]))
    assert all_ranks(
        abs(float(jax.jit(loss)(x, logits, maps)) - float(reference(x, logits, maps))) < 1e-4
        and np.allclose(got[0], want[0], atol=1e-5) and np.allclose(got[1], want[1], atol=1e-5)
        and np.allclose(np.asarray(got[2])[mine], maps_grad[mine], atol=1e-4))


def test_moe_capacity_pads_and_counts_drops(comm):
    experts, k, x, logits, _, _ = _moe_problem(comm, tokens=16)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=0.5)
    chosen, weights = _gate(logits, k)
    expert_x, key = jax.jit(dispatcher.dispatch)(x, chosen, weights)
    slots = dispatcher.slots(16, k)
    stats = dispatcher.stats
    sent = comm.allreduce(np.array([chosen.size]))[0]
    assert all_ranks(expert_x.shape == (experts // comm.size, slots, x.shape[1])
                     and stats.dropped.sum() > 0
                     and stats.tokens_per_expert.sum() + stats.dropped.sum() == sent)


def test_moe_needs_a_capacity(comm):
    with pytest.raises(ValueError, match="give a capacity_factor"):
        cj.Dispatcher(comm, comm.size, capacity_factor=None)
