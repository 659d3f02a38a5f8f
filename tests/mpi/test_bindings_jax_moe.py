"""commlib.bindings.jax.Dispatcher (bindings/jax/_moe.py): MoE dispatch and combine as jnp in
the jitted program, against a per-token loop in NumPy that every rank
computes from every rank's seeded inputs (so each rank knows what it must
get), and against the eager core ``commlib.moe.Dispatcher``."""

import math

import numpy as np
import pytest

import commlib
import commlib.moe as moe

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

# routing across ranks, an odd number of them included
WORLD_SIZES = (2, 3)

jax = requires.module("jax")
jnp = jax.numpy
cj = requires.module("commlib.bindings.jax")


def _tokens_of(rank, tokens, hidden, experts, k, dtype, hot=0.0, absent=False):
    """Rank ``rank``'s x, experts, weights and loss probe (x rounded to dtype)."""
    rng = np.random.default_rng(100 + rank)
    x = np.asarray(jnp.asarray(rng.standard_normal((tokens, hidden)), dtype), np.float64)
    logits = rng.standard_normal((tokens, experts))
    logits[:, 0] += hot  # a hot expert 0: drops under a small capacity
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k].astype(np.int32)
    if absent:
        chosen[::3, -1] = -1  # some tokens with a choice of no expert
    weights = (rng.random((tokens, k)) + 0.1).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return x, chosen, weights, rng.standard_normal((tokens, hidden))


def _maps(experts, hidden, dtype):
    """f_e(x) = x @ maps[e], the same on every rank, rounded to dtype."""
    maps = np.random.default_rng(7).standard_normal((experts, hidden, hidden)) / hidden
    return np.asarray(jnp.asarray(maps, dtype), np.float64)


def _kept(chosen, weights, experts, capacity, policy):
    """The per-token loop's drops: for each expert, the capacity heaviest
    (probs) or earliest (position) of this rank's assignments, ties to the
    earlier; returns kept [T, k] and each kept choice's slot (token order)."""
    kept = np.zeros(chosen.shape, bool)
    slot = np.full(chosen.shape, -1)
    for e in range(experts):
        pairs = [(t, j) for t in range(chosen.shape[0]) for j in range(chosen.shape[1])
                 if chosen[t, j] == e]
        if policy == "probs":
            pairs.sort(key=lambda pair: -weights[pair])  # stable: ties stay in order
        for s, (t, j) in enumerate(sorted(pairs[:capacity])):
            kept[t, j], slot[t, j] = True, s
    return kept, slot


def _reference(comm, tokens, hidden, experts, k, dtype, capacity, policy, **options):
    """Per-token loop in float64 over every rank's inputs: this rank's y, dx,
    d weights, and d of its local maps (the sum of every rank's loss), and
    the global kept / dropped counts per expert."""
    maps = _maps(experts, hidden, dtype)
    local = experts // comm.size
    mine = slice(comm.rank * local, (comm.rank + 1) * local)
    d_maps = np.zeros_like(maps)
    kept_per_expert = np.zeros(experts, np.int64)
    dropped_per_expert = np.zeros(experts, np.int64)
    for rank in range(comm.size):
        x, chosen, weights, probe = _tokens_of(rank, tokens, hidden, experts, k, dtype,
                                               **options)
        kept, slot = _kept(chosen, weights, experts, capacity, policy)
        y, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros(weights.shape)
        for t in range(tokens):
            for j in range(k):
                e = chosen[t, j]
                if e < 0:
                    continue
                if not kept[t, j]:
                    dropped_per_expert[e] += 1
                    continue
                kept_per_expert[e] += 1
                y[t] += weights[t, j] * (x[t] @ maps[e])
                dx[t] += weights[t, j] * (maps[e] @ probe[t])
                dw[t, j] = probe[t] @ (x[t] @ maps[e])
                d_maps[e] += weights[t, j] * np.outer(x[t], probe[t])
        if rank == comm.rank:
            want = dict(y=y, dx=dx, dw=dw, kept=kept, slot=slot, x=x, chosen=chosen,
                        weights=weights, probe=probe)
    want.update(d_maps=d_maps[mine], maps=maps[mine], kept_per_expert=kept_per_expert,
                dropped_per_expert=dropped_per_expert)
    return want


def _close(got, want, dtype):
    """float32 to 1e-5 of the reference's scale; bfloat16 to 3e-2 of it."""
    scale = float(np.abs(want).max()) or 1.0
    return float(np.abs(np.asarray(got, np.float64) - want).max()) <= \
        (3e-2 if dtype == "bfloat16" else 1e-5) * scale


def _moe_loss(dispatcher):
    def loss(x, weights, maps, chosen, probe):
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        expert_y = jnp.einsum("lsh,lhg->lsg", expert_x, maps)
        y = dispatcher.combine(expert_y, handle)
        return (y.astype(jnp.float32) * probe).sum(), (y, expert_x, handle)
    return loss


CASES = [  # (capacity_factor, drop_policy, hot, absent): no drops, then drops
    (None, "probs", 0.0, False),
    (0.5, "probs", 2.0, False),
    (0.5, "position", 2.0, True),
]


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("capacity_factor,policy,hot,absent", CASES)
@pytest.mark.parametrize("impl", arrayimpl.params(("jax", "jax-cuda")))
def test_jit_grad_matches_per_token_loop(comm, impl, dtype, capacity_factor, policy, hot,
                                         absent):
    """On the CPU and (gpu mark) on a GPU."""
    tokens, hidden, k = 12, 6, 2
    experts = 2 * comm.size
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=capacity_factor,
                               drop_policy=policy)
    capacity = tokens if capacity_factor is None else math.ceil(tokens * k / experts
                                                                * capacity_factor)
    want = _reference(comm, tokens, hidden, experts, k, dtype, capacity, policy, hot=hot,
                      absent=absent)
    x, maps = impl.asarray(want["x"], dtype), impl.asarray(want["maps"], dtype)
    weights, chosen = impl.asarray(want["weights"]), impl.asarray(want["chosen"])
    probe = impl.asarray(want["probe"], "float32")
    step = jax.jit(jax.value_and_grad(_moe_loss(dispatcher), argnums=(0, 1, 2), has_aux=True))
    before = dispatcher.stats
    (_, (y, expert_x, handle)), (dx, dw, d_maps) = step(x, weights, maps, chosen, probe)
    stats = dispatcher.stats
    key = np.asarray(handle.key)
    local = experts // comm.size
    mine = slice(comm.rank * local, (comm.rank + 1) * local)
    kept_slot = want["chosen"] * capacity + want["slot"]
    ok = (y.dtype == dtype and dx.dtype == dtype and dw.dtype == jnp.float32
          and d_maps.dtype == dtype
          and expert_x.shape == (experts // comm.size, dispatcher.slots(tokens, k), hidden)
          and _close(y, want["y"], dtype) and _close(dx, want["dx"], dtype)
          and _close(dw, want["dw"], dtype) and _close(d_maps, want["d_maps"], dtype)
          # the key: the send-buffer row of a kept choice, -1 for dropped or absent
          and np.array_equal(key, np.where(want["kept"], kept_slot, -1))
          and np.all(np.asarray(dw)[~want["kept"]] == 0)  # dropped: no weight gradient
          and np.array_equal(stats.tokens_per_expert - before.tokens_per_expert,
                             want["kept_per_expert"])
          and isinstance(handle, moe.MoEHandle) and handle.stats is None
          and np.array_equal(np.asarray(handle.tokens_per_expert),
                             want["kept_per_expert"][mine])
          and np.array_equal(stats.dropped - before.dropped, want["dropped_per_expert"])
          and ((stats.dropped.sum() > before.dropped.sum()) == (capacity_factor is not None)))
    assert all_ranks(ok)


def test_expert_x_layout(comm):
    """expert_x[l, r * capacity + s]: the s-th kept token (token order) that
    rank r sent to local expert l; zero rows after them."""
    tokens, hidden, k, experts = 10, 3, 2, 2 * comm.size
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=0.6)
    capacity = dispatcher.capacity(tokens, k)
    local = experts // comm.size
    expected = np.zeros((local, comm.size * capacity, hidden))
    for rank in range(comm.size):
        x, chosen, weights, _ = _tokens_of(rank, tokens, hidden, experts, k, "float32",
                                           hot=1.0)
        kept, slot = _kept(chosen, weights, experts, capacity, "probs")
        for t, j in zip(*np.nonzero(kept)):
            e = chosen[t, j]
            if e // local == comm.rank:
                expected[e % local, rank * capacity + slot[t, j]] = x[t]
        if rank == comm.rank:
            mine = (jnp.asarray(x, jnp.float32), jnp.asarray(chosen), jnp.asarray(weights))
    expert_x, _ = jax.jit(dispatcher.dispatch)(*mine)
    assert all_ranks(np.array_equal(np.asarray(expert_x), expected.astype(np.float32)))


@pytest.mark.parametrize("hierarchical", [False, True])
def test_matches_the_eager_core_without_drops(comm, hierarchical):
    """Nothing dropped: y, d x and the stats' loads equal commlib.moe's, which
    runs eagerly on NumPy with the same capacity (two-hop or flat: JAX's
    one padded exchange gives what either path gives)."""
    tokens, hidden, k, experts = 16, 4, 3, 4 * comm.size
    x, chosen, weights, probe = _tokens_of(comm.rank, tokens, hidden, experts, k, "float32")
    x = x.astype(np.float32)
    maps = _maps(experts, hidden, "float32").astype(np.float32)
    local = experts // comm.size
    mine = maps[comm.rank * local:(comm.rank + 1) * local]
    core = moe.Dispatcher(comm, experts, capacity_factor=float(experts),
                          hierarchical=hierarchical)
    core_x, handle = core.dispatch(x, chosen, weights)
    starts = np.cumsum(handle.tokens_per_expert)[:-1]  # core_x is grouped by local expert
    expert_y = np.concatenate([c @ mine[e] for e, c in enumerate(np.split(core_x, starts))])
    core_y = core.combine(expert_y, handle)
    d_expert_y, core_dw = core.combine_backward(expert_y, probe.astype(np.float32), handle, k)
    core_dx = core.dispatch_backward(np.concatenate(
        [c @ mine[e].T for e, c in enumerate(np.split(d_expert_y, starts))]), handle)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=float(experts))
    loss = _moe_loss(dispatcher)
    (_, (y, _, _)), (dx, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        jnp.asarray(x), jnp.asarray(weights), jnp.asarray(mine), jnp.asarray(chosen),
        jnp.asarray(probe, jnp.float32))
    assert all_ranks(np.allclose(np.asarray(y), core_y, atol=1e-6)
                     and np.allclose(np.asarray(dx), core_dx, atol=1e-5)
                     and np.allclose(np.asarray(dw), core_dw, atol=1e-5)
                     and np.array_equal(dispatcher.stats.tokens_per_expert,
                                        core.stats.tokens_per_expert)
                     and dispatcher.stats.dropped.sum() == core.stats.dropped.sum() == 0)


def _many_dispatches(comm, count, scanned):
    """A jitted training step that makes ``count`` dispatches (of x scaled
    by 1/count ... 1) before any of their combines, then the combines, and
    the loss sum_i (i % 3 + 1) <y_i, probe>; checked against a per-token
    loop (y_i = scale_i * y, no drops)."""
    tokens, hidden, k = 4, 3, 2
    experts = 2 * comm.size
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=float(experts))
    x, chosen, weights, probe = _tokens_of(comm.rank, tokens, hidden, experts, k, "float32")
    maps = _maps(experts, hidden, "float32")
    local = experts // comm.size
    mine = maps[comm.rank * local:(comm.rank + 1) * local]
    scales = np.arange(1, count + 1, dtype=np.float32) / count
    factors = (np.arange(count) % 3 + 1).astype(np.float32)

    def expert(expert_x, maps):
        return jnp.einsum("lsh,lhg->lsg", expert_x, maps)

    def step(x, weights, maps, chosen, probe, scales, factors):
        if scanned:  # the dispatches' keys and rows stacked by a scan, then a scan of combines
            _, sent = jax.lax.scan(lambda c, s: (c, dispatcher.dispatch(x * s, chosen, weights)),
                                   0, scales)
            outs = jax.lax.scan(lambda c, item: (c, dispatcher.combine(
                expert(item[0], maps), item[1])), 0, sent)[1]
            return jnp.einsum("i,itg,tg->", factors, outs, probe)
        sent = [dispatcher.dispatch(x * scales[i], chosen, weights) for i in range(count)]
        outs = [dispatcher.combine(expert(expert_x, maps), handle)
                for expert_x, handle in sent]
        return sum((y * probe).sum() * factors[i] for i, y in enumerate(outs))

    before = dispatcher.stats.tokens_per_expert.sum()
    loss, (dx, dw) = jax.jit(jax.value_and_grad(step, argnums=(0, 1)))(
        *(jnp.asarray(a, jnp.float32) for a in (x, weights, mine)), jnp.asarray(chosen),
        *(jnp.asarray(a, jnp.float32) for a in (probe, scales, factors)))
    factor = float(factors @ scales)
    y = np.stack([sum(weights[t, j] * (x[t] @ maps[chosen[t, j]]) for j in range(k))
                  for t in range(tokens)])
    want_dx = factor * np.stack([sum(weights[t, j] * (maps[chosen[t, j]] @ probe[t])
                                     for j in range(k)) for t in range(tokens)])
    want_dw = factor * np.array([[probe[t] @ (x[t] @ maps[chosen[t, j]]) for j in range(k)]
                                 for t in range(tokens)])
    return (np.isclose(float(loss), factor * (y * probe).sum(), rtol=1e-5)
            and np.allclose(np.asarray(dx), want_dx, rtol=1e-4, atol=1e-4)
            and np.allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)
            and dispatcher.stats.tokens_per_expert.sum() - before
            == count * comm.size * tokens * k)


def test_a_step_with_200_dispatches_before_their_combines(comm):
    """200 dispatches in flight in one jitted training step (the old binding
    kept the last 64 in a host registry); every combine finds its rows and
    every dispatch is counted once."""
    assert all_ranks(_many_dispatches(comm, 200, scanned=True))


def test_independent_dispatches_unrolled_in_one_step(comm):
    """Unrolled, the dispatches are independent chains of transfers, which
    XLA runs in its schedule's order (not program order): the same on every
    rank, because the program is (no rank-dependent constant in it)."""
    assert all_ranks(_many_dispatches(comm, 12, scanned=False))


def _small(comm, tokens=6, k=2):
    experts = 2 * comm.size
    x, chosen, weights, _ = _tokens_of(comm.rank, tokens, 4, experts, k, "float32")
    return experts, jnp.asarray(x, jnp.float32), jnp.asarray(chosen), jnp.asarray(weights)


def test_an_expert_out_of_range_inside_jit_raises_on_every_rank(comm):
    """The ids are traced, so the verdict comes when the program runs: every
    rank gets every rank's id range with the counts, and all raise."""
    experts, x, chosen, weights = _small(comm)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=2.0)
    bad = comm.size - 1
    if comm.rank == bad:
        chosen = chosen.at[0, 0].set(experts)
    run = jax.jit(lambda x, c, w: dispatcher.dispatch(x, c, w)[0].sum())
    try:
        run(x, chosen, weights).block_until_ready()
        message = ""
    except Exception as error:  # XLA's runtime error around the callback's
        message = str(error)
    ok = (f"moe.dispatch was rejected by rank(s) {bad}:" in message
          and f"rank {bad}: expert indices must lie in [-1, {experts}) (-1: no expert), "
              f"got values from" in message)
    # the communicator and the dispatcher still work afterwards
    _, x, chosen, weights = _small(comm)
    total = float(run(x, chosen, weights))
    assert all_ranks(ok and np.isfinite(total))


def test_bad_input_known_when_tracing_raises_on_every_rank(comm):
    experts, x, chosen, weights = _small(comm)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=2.0)
    bad = comm.size - 1
    ids = np.asarray(chosen)
    if comm.rank == bad:
        ids = ids.copy()
        ids[1, 1] = -2
    # outside jit the ids are known when the dispatch is traced: checked then
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: dispatcher.dispatch(x, jnp.asarray(ids), weights),
                      match=f"rank {bad}: expert indices must lie in")
    floats = chosen.astype(jnp.float32) if comm.rank == bad else chosen
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax.jit(dispatcher.dispatch)(x, floats, weights),
                      match="experts must be integers")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax.jit(dispatcher.dispatch)(x, chosen, weights[:, :1]),
                      match="weights must have the shape of experts")


def test_shapes_that_differ_between_ranks_fail_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    experts, x, chosen, weights = _small(comm, tokens=6 if comm.rank else 8)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=2.0)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax.jit(dispatcher.dispatch)(x, chosen, weights),
                      match="ranks called moe.dispatch with different arguments")
    experts, x, chosen, weights = _small(comm)
    expert_x, handle = jax.jit(dispatcher.dispatch)(x, chosen, weights)
    wide = expert_x if comm.rank else jnp.concatenate([expert_x, expert_x], axis=2)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax.jit(dispatcher.combine)(wide, handle),
                      match="ranks called moe.combine with different arguments")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax.jit(dispatcher.combine)(expert_x[:, 1:], handle),
                      match="expert_y must have one row per expert_x row")


def test_eager_calls_and_rows_of_any_shape(comm):
    """Outside jit too, with rows [T, 2, 3] and an expert output of another width."""
    tokens, k, experts = 5, 2, 2 * comm.size
    rng = np.random.default_rng(comm.rank)
    x = jnp.asarray(rng.standard_normal((tokens, 2, 3)), jnp.float32)
    _, chosen, weights, _ = _tokens_of(comm.rank, tokens, 6, experts, k, "float32")
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=float(experts))
    expert_x, handle = dispatcher.dispatch(x, jnp.asarray(chosen), jnp.asarray(weights))
    y = dispatcher.combine(expert_x.sum(axis=-1), handle)
    want = (np.asarray(x).sum(axis=-1)
            * np.where(chosen >= 0, weights, 0).sum(axis=1)[:, None])
    assert all_ranks(expert_x.shape == (experts // comm.size, dispatcher.slots(tokens, k), 2, 3)
                     and y.shape == (tokens, 2) and np.allclose(np.asarray(y), want, atol=1e-6))


def test_hierarchical_is_refused_not_run_flat(comm):
    """The padded exchange has no two-hop path: refused on every rank."""
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: cj.Dispatcher(comm, comm.size, hierarchical=True),
                      match="hierarchical=True is not available in the JAX Dispatcher")


def test_fixed_layout_from_max_tokens_per_rank(comm):
    """With ``max_tokens_per_rank`` the layout comes from it, so ranks may
    dispatch different numbers of tokens; y equals the per-token sum."""
    k, hidden, experts, most = 2, 3, 2 * comm.size, 9
    tokens = 5 + comm.rank % 3
    dispatcher = cj.Dispatcher(comm, experts, max_tokens_per_rank=most)
    x, chosen, weights, _ = _tokens_of(comm.rank, tokens, hidden, experts, k, "float32")
    expert_x, handle = jax.jit(dispatcher.dispatch)(jnp.asarray(x, jnp.float32),
                                                    jnp.asarray(chosen), jnp.asarray(weights))
    y = jax.jit(dispatcher.combine)(expert_x * 2, handle)
    want = 2 * x * weights.sum(axis=1)[:, None]
    assert all_ranks(expert_x.shape == (experts // comm.size, comm.size * most, hidden)
                     and np.allclose(np.asarray(y), want, atol=1e-6)
                     and dispatcher.collect_stats().tokens_per_expert.sum()
                     == comm.allreduce(np.array([tokens * k]))[0]
                     and dispatcher.collect_stats().tokens_per_expert.sum() == 0)
