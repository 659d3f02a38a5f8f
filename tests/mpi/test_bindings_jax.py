"""JAX bindings under jit and grad against jax.nn.dot_product_attention on
the unsharded sequence."""

import numpy as np
import pytest

from commlib import CollectiveMismatchError, ring
from commlib.sequence.common_masks import block_diagonal, prefix_lm
from commlib.sequence.masks import Mask, Slice, from_cu_seqlens

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

# the traced transfers between ranks. Odd sizes change the layouts: the
# attention conformance matrix runs this binding inside jit and vjp at 3 ranks
# (tests/conformance.py), and test_bindings_jax_moe the traced MoE, so this
# file's cases run at 2 only (each compiles for seconds: 211 s at 3 ranks)
WORLD_SIZES = (2,)

jax = requires.module("jax")
jnp = jax.numpy
cj = requires.module("commlib.bindings.jax")

SEQ, HEADS, DIM = 24, 12, 8


def reference(q, k, v, causal=False, mask=None):
    group = q.shape[2] // k.shape[2]
    return jax.nn.dot_product_attention(q, jnp.repeat(k, group, axis=2),
                                        jnp.repeat(v, group, axis=2), is_causal=causal,
                                        mask=mask)


def _close(got, want, dtype):
    """float32 to 1e-5 of the reference's scale; bfloat16 to 2e-2 (measured:
    7.9e-3 at 2 and 3 ranks, a Ulysses gradient in zigzag_docs)."""
    scale = float(np.abs(want).max()) or 1.0
    return float(np.abs(np.asarray(got, np.float32) - want).max()) <= \
        (2e-2 if dtype == "bfloat16" else 1e-5) * scale


# every kind in every layout in float32, causal with GQA and plain without;
# bfloat16 on a few (each case compiles its own programs)
CASES = [(kind, layout, 1 if causal else HEADS, causal, "float32")
         for kind in ("ring", "ulysses", "hybrid") for layout in ring.LAYOUTS
         for causal in (False, True)] + \
    [("ring", "zigzag", 1, True, "bfloat16"), ("ulysses", "zigzag_docs", HEADS, True, "bfloat16"),
     ("hybrid", "zigzag", 1, False, "bfloat16")]


@pytest.mark.quick_sample(2)  # Ulysses in jit: the matrix's JAX cases, test_ulysses_uneven
@pytest.mark.parametrize("kind, layout, kv_heads, causal, dtype", CASES)
@pytest.mark.parametrize("impl", arrayimpl.params(("jax", "jax-cuda")))
def test_jit_and_grad_match_unsharded_attention(comm, impl, kind, layout, kv_heads, causal,
                                                dtype):
    """On the CPU and (gpu mark) on a GPU, where the transfers run on XLA's stream."""
    rng = np.random.default_rng(kv_heads)
    full = [rng.standard_normal((1, SEQ, h, DIM)).astype(np.float32)
            for h in (HEADS, kv_heads, kv_heads, HEADS)]
    q, k, v, probe = (impl.asarray(ring.shard_sequence(x, comm, layout=layout), dtype)
                      for x in full)
    degree = 2 if comm.size % 2 == 0 else comm.size
    options = dict(layout=layout, causal=causal)
    attend = {
        "ring": lambda q, k, v: cj.ring_attention(q, k, v, comm, **options),
        "ulysses": lambda q, k, v: cj.ulysses_attention(q, k, v, comm, **options),
        "hybrid": lambda q, k, v: cj.hybrid_attention(q, k, v, comm, degree, **options),
    }[kind]
    out = jax.jit(attend)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: (attend(q, k, v).astype(jnp.float32)
                                              * probe.astype(jnp.float32)).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    exact = [np.asarray(jnp.asarray(x, dtype), np.float32) for x in full]  # inputs as rounded
    want = reference(*exact[:3], causal)
    want_grads = jax.grad(lambda q, k, v: (reference(q, k, v, causal) * exact[3]).sum(),
                          argnums=(0, 1, 2))(*exact[:3])
    # every rank gathers every result (a collective), whatever it finds
    gathered = [ring.unshard_sequence(np.asarray(x, np.float32), comm, layout=layout)
                for x in (out, *grads)]
    checks = {"type": isinstance(out, jax.Array) and all(
        x.dtype == dtype for x in (out, *grads))}
    for name, got, expected in zip(("out", "dq", "dk", "dv"), gathered, (want, *want_grads)):
        checks[name] = _close(got, np.asarray(expected), dtype)
    assert all_ranks(all(checks.values())), checks


# (kind, mask, method): the sparse exchange (auto takes it for the documents)
# and the ring (auto for prefix-LM), through the ring and the hybrid
MASKED = [("ring", "block-diagonal", "auto"), ("ring", "block-diagonal", "sparse"),
          ("ring", "prefix-lm", "auto"), ("ring", "prefix-lm", "sparse"),
          ("hybrid", "block-diagonal", "auto"), ("hybrid", "prefix-lm", "sparse"),
          ("hybrid-ulysses", "block-diagonal", "sparse"),
          ("ring", "first-keys", "sparse")]  # contiguous: ranks without keys 0-5 send none


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("kind, name, method", MASKED)
def test_masks_under_jit_and_grad_match_unsharded_attention(comm, kind, name, method):
    """mask= in the balanced layout (first-keys: contiguous). The sparse
    exchange's all-to-all had no traced form (AttributeError: 'TracedComm'
    object has no attribute 'alltoallv')."""
    mask = {"block-diagonal": lambda: block_diagonal(SEQ, 4, causal=False),
            "prefix-lm": lambda: prefix_lm(SEQ, 8),
            "first-keys": lambda: Mask([Slice((0, SEQ), (0, 6), "full")], length=SEQ)}[name]()
    rng = np.random.default_rng(2)
    full = [rng.standard_normal((1, SEQ, h, DIM)).astype(np.float32)
            for h in (HEADS, 2, 2, HEADS)]
    layout = "contiguous" if name == "first-keys" else "balanced"
    q, k, v, probe = (jnp.asarray(ring.shard_sequence(x, comm, layout=layout, mask=mask))
                      for x in full)
    options = dict(layout=layout, causal=False, mask=mask, method=method)
    # "hybrid": a ring of single ranks (of groups of 2 at 4 ranks); "hybrid-ulysses":
    # one group of every rank, a ring of one
    degree = comm.size if kind == "hybrid-ulysses" else (2 if comm.size == 4 else 1)

    def attend(q, k, v):
        if kind == "ring":
            return cj.ring_attention(q, k, v, comm, **options)
        return cj.hybrid_attention(q, k, v, comm, degree, **options)
    out = jax.jit(attend)(q, k, v)
    grads = jax.jit(jax.grad(lambda q, k, v: (attend(q, k, v) * probe).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    dense = jnp.asarray(mask.dense())[None, None]
    want = reference(*full[:3], mask=dense)
    want_grads = jax.grad(lambda q, k, v: (reference(q, k, v, mask=dense) * full[3]).sum(),
                          argnums=(0, 1, 2))(*full[:3])
    gathered = [ring.unshard_sequence(np.asarray(x), comm, layout=layout, mask=mask)
                for x in (out, *grads)]
    checks = {part: _close(got, np.asarray(expected), "float32") for part, got, expected in
              zip(("out", "dq", "dk", "dv"), gathered, (want, *want_grads))}
    assert all_ranks(all(checks.values())), checks


def test_a_mask_of_another_length_raises_on_every_rank_under_jit(comm):
    """A 10-token mask over shards of SEQ tokens: refused when tracing (the
    queries past 10 came back 0)."""
    q = jnp.asarray(ring.shard_sequence(np.ones((1, SEQ, HEADS, DIM), np.float32), comm,
                                        layout="zigzag"))
    mask = from_cu_seqlens([0, 10], causal=True)
    raises_everywhere(CollectiveMismatchError, lambda: jax.jit(
        lambda q: cj.ring_attention(q, q, q, comm, layout="zigzag", causal=False, mask=mask))(q),
        match=f"the mask covers 10 tokens but the shards hold {SEQ}")


def test_independent_calls_in_one_program_keep_their_transfers_apart(comm):
    """Two ring attentions on unrelated inputs, forward and backward, in one
    jitted step: XLA may schedule their transfers in any order, and differently
    on each rank (their programs differ), so only commlib's ordering keeps
    one call's K/V from meeting another's (same shapes, same bytes)."""
    rng = np.random.default_rng(5)
    full = [rng.standard_normal((1, SEQ, HEADS, DIM)).astype(np.float32) for _ in range(8)]
    shards = [jnp.asarray(ring.shard_sequence(x, comm, layout="zigzag")) for x in full]

    def loss(attend, *arrays):
        a, b = attend(*arrays[0:3]), attend(*arrays[4:7])
        return (a * arrays[3]).sum() + (b * arrays[7]).sum()

    sharded = lambda *a: cj.ring_attention(*a, comm, layout="zigzag", causal=True)  # noqa: E731
    grads = jax.jit(jax.grad(lambda *a: loss(sharded, *a), argnums=(0, 1, 2, 4, 5, 6)))(*shards)
    want = jax.grad(lambda *a: loss(lambda q, k, v: reference(q, k, v, True), *a),
                    argnums=(0, 1, 2, 4, 5, 6))(*full)
    got = [ring.unshard_sequence(np.asarray(g), comm, layout="zigzag") for g in grads]
    assert all_ranks(all(_close(g, np.asarray(w), "float32") for g, w in zip(got, want)))


def test_transfers_see_xlas_own_buffers(comm, monkeypatch):
    """On the CPU the callback sends from the jitted function's input buffer
    and receives into the buffer the result is: no operand is copied."""
    from commlib.bindings.jax._traced_comm import traced

    shift = traced(comm)
    seen = []
    real = shift.runtime.ring_shift_async

    def spy(x, amount=1, lane=0, out=None):
        seen.append((x.__array_interface__["data"][0], out.__array_interface__["data"][0]))
        return real(x, amount, lane, out=out)
    monkeypatch.setattr(shift.runtime, "ring_shift_async", spy)

    def rotate(x):
        with shift.ordered():
            return shift.ring_shift(x)
    x = jnp.arange(1024, dtype=jnp.float32) + comm.rank
    y = jax.jit(rotate)(x)
    ok = seen == [(x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer())] and np.array_equal(
        np.asarray(y), np.arange(1024, dtype=np.float32) + (comm.rank - 1) % comm.size)
    assert all_ranks(ok)


def test_shapes_that_differ_between_ranks_fail_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    local = 6 if comm.rank else 8
    q = jnp.ones((1, local, HEADS, DIM), jnp.float32)
    try:
        jax.jit(lambda q: cj.ring_attention(q, q, q, comm, layout="zigzag",
                                            causal=False))(q).block_until_ready()
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


@pytest.mark.full  # the quick tier's: test_bindings_jax_moe's jit and grad against a loop
def test_moe_dispatch_combine_under_jit_and_grad(comm):
    experts, k, x, logits, maps, probe = _moe_problem(comm)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=float(experts))  # no drops
    local = experts // comm.size
    mine = slice(comm.rank * local, (comm.rank + 1) * local)

    def loss(x, logits, maps):
        chosen, weights = _gate(logits, k)
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        expert_y = jnp.einsum("lsh,lhg->lsg", expert_x, maps[mine])
        return (dispatcher.combine(expert_y, handle) * probe).sum()

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
    expert_x, _ = jax.jit(dispatcher.dispatch)(x, chosen, weights)
    slots = dispatcher.slots(16, k)
    stats = dispatcher.stats
    sent = comm.allreduce(np.array([chosen.size]))[0]
    assert all_ranks(expert_x.shape == (experts // comm.size, slots, x.shape[1])
                     and stats.dropped.sum() > 0
                     and stats.tokens_per_expert.sum() + stats.dropped.sum() == sent)


def test_a_mesh_over_this_process_device_works_across_processes(comm):
    """The supported layout: one process per device, each with a Mesh of
    its own device(s) for its jit shardings, commlib between processes."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("local",))
    replicated = NamedSharding(mesh, PartitionSpec())
    rng = np.random.default_rng(3)
    full = [rng.standard_normal((1, SEQ, HEADS, DIM)).astype(np.float32) for _ in range(3)]
    q, k, v = (jax.device_put(ring.shard_sequence(x, comm, layout="zigzag"), replicated)
               for x in full)
    attend = jax.jit(lambda q, k, v: cj.ring_attention(q, k, v, comm, layout="zigzag",
                                                       causal=True),
                     in_shardings=replicated, out_shardings=replicated)
    out = attend(q, k, v)
    want = np.asarray(reference(*full, True))
    assert all_ranks(out.sharding == replicated and np.allclose(
        ring.unshard_sequence(np.asarray(out), comm, layout="zigzag"), want, atol=1e-5))
