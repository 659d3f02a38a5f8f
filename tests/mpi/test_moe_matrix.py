"""The MoE conformance matrix: one test body over a covering array
(``tests/covering.py``) of framework (the NumPy core, the torch binding, the
JAX binding under ``jit``) x mode (counted with a capacity factor, fixed
capacity, FP8 rows) x path (flat, two-hop, two-hop pipelined with
``pipeline_chunks`` given to the Dispatcher) x sync/async x token spread
(among them tokens naming an expert twice or three times) x expert
placement (none; ``moe.rebalance`` of a skewed load with one redundant
expert per rank; the same with the last rank drained). Every case either
equals a per-token loop in NumPy (y, the kept and dropped assignments per
expert, the handle's rows per expert, and where the framework has autograd
the gradients of x and the weights) or is refused on every rank with the
error it names. Nothing is skipped.

Emulated nodes for the two-hop paths: 2 ranks run as 2 nodes x 1, 3 as
3 x 1, 4 as 2 x 2 (COMMLIB_RANKS_PER_NODE through ``ranks_per_node``).

Below the matrix: one routing whose tokens name experts more than once
through every path, with the same statistics on each (issue 53: the
low-latency layout counted a repeated expert once); ``pipeline_chunks`` as
one option of the three Dispatchers (issue 36: the torch one ignored it)."""

import math

import numpy as np
import pytest

import commlib
import commlib.moe as moe
from commlib.moe import lowlatency
from commlib.moe.quantize import dequantize_fp8, quantize_fp8
from commlib.tools.simulate import zipf_popularity

import covering
import requires
import tiers
from conftest import all_ranks, raises_everywhere

WORLD_SIZES = (2, 3, 4)  # 1 rank has no second node, so no two-hop path to test

torch = requires.module("torch")
jax = requires.module("jax")
jnp = jax.numpy
torch_moe = requires.module("commlib.bindings.torch")
jax_moe = requires.module("commlib.bindings.jax")

HIDDEN, TOKENS, CHUNKS = 8, 20, 3
# mode: (capacity_factor, fixed capacity, quantize): counted drops under
# its capacity factor (the hot expert always, random routing sometimes)
MODES = {"counted": (1.0, False, None), "fixed": (None, True, None),
         "fp8": (None, False, "fp8")}
PATHS = {"flat": (False, None), "two-hop": (True, 1), "pipelined": (True, CHUNKS)}
FACTORS = {"framework": ["numpy", "torch", "jax"], "mode": list(MODES),
           "path": list(PATHS), "calls": ["sync", "async"],
           "spread": ["random", "no_tokens", "one_expert", "k1", "minus_one", "duplicates"],
           "placement": ["none", "replicated", "drained"]}
# numpy and torch: every pair, and every framework x mode x path. JAX:
# every mode x spread of the flat path (its only one), and each mode with
# each two-hop path once (refused: no need to vary the rest)
ALL_CASES = covering.covering(dict(FACTORS, framework=["numpy", "torch"]),
                              full=[("framework", "mode", "path")], seed=0)
ALL_CASES += [dict(case, framework="jax", path="flat") for case in covering.covering(
    {name: FACTORS[name] for name in ("mode", "calls", "spread", "placement")},
    full=[("mode", "spread")], seed=0)]
ALL_CASES += covering.covering(dict(framework=["jax"], mode=list(MODES),
                                    path=["two-hop", "pipelined"], calls=["sync"],
                                    spread=["random"], placement=["none"]), seed=0)
# the quick tier (tests/tiers.py) runs a seeded sample of them
QUICK_CASES = 16
CASES = ALL_CASES if tiers.full() else covering.sample(ALL_CASES, QUICK_CASES)


def _expected_refusal(case):
    """(exception type, message part, where) when ``case`` must be refused
    on every rank, else None. ``where``: "init", "dispatch" or "async"."""
    if case["framework"] == "jax":
        if PATHS[case["path"]][0]:
            return (commlib.CollectiveMismatchError,
                    "hierarchical=True is not available in the JAX Dispatcher", "init")
        if case["spread"] == "no_tokens" and not MODES[case["mode"]][1]:
            # the padded exchange needs one T everywhere unless max_tokens_per_rank says
            return commlib.CollectiveMismatchError, "different arguments", "dispatch"
        if case["calls"] == "async":  # XLA schedules the transfer: no _async calls
            return AttributeError, "dispatch_async", "async"
    return None


@pytest.fixture(scope="module")
def world(comm):
    nodes = commlib.init(ranks_per_node=2 if comm.size % 4 == 0 else 1)
    yield nodes
    nodes.free()


def _routing(comm, spread, num_experts):
    """This rank's x [T, H] float32, experts [T, k] int64 (distinct per
    token but for "duplicates"), weights [T, k] float32 and loss probe
    [T, H]."""
    rng = np.random.default_rng([36, comm.rank])
    tokens = 0 if spread == "no_tokens" and comm.rank == 0 else TOKENS
    k = 1 if spread == "k1" else 3
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    experts = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k].astype(np.int64)
    if spread == "one_expert":  # every token's first choice: the last rank's last expert
        hot = num_experts - 1
        experts[experts == hot] = experts[:, 0:1].repeat(k, axis=1)[experts == hot]
        experts[:, 0] = hot
    if spread == "minus_one":
        experts[rng.random(experts.shape) < 0.3] = -1
        experts[:1] = -1  # a token with no expert at all
    if spread == "duplicates":  # an expert named twice, three times, and twice beside a -1
        experts[::3, 1] = experts[::3, 0]
        experts[::5, :] = experts[::5, :1]
        experts[1::7, 1] = experts[1::7, 0]
        experts[1::7, 2] = -1
    weights = (rng.random((tokens, k)) + 0.1).astype(np.float32)
    probe = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    return x, experts, weights, probe


def skewed_load(num_experts):
    """A skewed (Zipf s=1.2, shuffled) load, the same on every rank."""
    return zipf_popularity(num_experts, 1.2, 45)


def placement_for(world, kind, num_experts):
    """None, or ``rebalance`` of ``skewed_load`` with one redundant expert
    per rank, with the last rank drained for "drained"."""
    if kind == "none":
        return None
    drain = (world.size - 1,) if kind == "drained" else ()
    return moe.rebalance(skewed_load(num_experts), ranks=world.size,
                         nodes=world.topology.num_nodes, redundant=world.size, drain=drain)


def slot_maps(maps, placement, rank, size):
    """This rank's experts' maps: its slots' logical experts' under a
    placement (an empty slot gets no rows: any map), else its own."""
    if placement is None:
        local = maps.shape[0] // size
        return maps[rank * local:(rank + 1) * local]
    logical = placement.slots[rank]
    return np.where((logical >= 0)[:, None, None], maps[np.maximum(logical, 0)], 0)


def _maps(num_experts):
    """f_e(x) = x @ maps[e], the same on every rank."""
    return np.stack([np.random.default_rng(1000 + e).standard_normal((HIDDEN, HIDDEN))
                     / math.sqrt(HIDDEN) for e in range(num_experts)]).astype(np.float32)


def _reference(x, experts, weights, probe, maps, capacity_factor, quantize, room=None):
    """The per-token loop in float64: y, dx, d weights of sum(y * probe),
    and the kept and dropped assignments per expert on this rank (each of
    a token's choices one, a repeated expert too), as ``kept_choices``
    keeps them; FP8 rows are the e4m3 rounding of x."""
    tokens, k = experts.shape
    num_experts = maps.shape[0]
    rows = x if quantize is None else dequantize_fp8(*quantize_fp8(x), np.float32)
    kept = kept_choices(experts, weights, capacity_factor, num_experts, room)
    y = np.zeros((tokens, HIDDEN))
    dx = np.zeros((tokens, HIDDEN))
    dw = np.zeros((tokens, k))
    per_expert = np.zeros(num_experts, np.int64)
    dropped = np.zeros(num_experts, np.int64)
    for t in range(tokens):
        for j in range(k):
            e = experts[t, j]
            if e < 0:
                continue
            if not kept[t, j]:
                dropped[e] += 1
                continue
            per_expert[e] += 1
            out = rows[t].astype(np.float64) @ maps[e]
            y[t] += weights[t, j] * out
            dx[t] += weights[t, j] * (maps[e].astype(np.float64) @ probe[t])
            dw[t, j] = out @ probe[t]
    return y, dx, dw, per_expert, dropped


def kept_choices(experts, weights, capacity_factor, num_experts, room=None):
    """[T, k]: the choices each expert keeps, the ceil(T k / E cf) heaviest
    of this rank's (ties to the earlier); without a capacity factor the
    earliest ``room`` (a layout of fixed size: C, or T for the JAX
    Dispatcher; None: all of them)."""
    tokens, k = experts.shape
    kept = experts >= 0
    cap = room if capacity_factor is None else math.ceil(tokens * k / num_experts
                                                         * capacity_factor)
    for e in range(num_experts if cap is not None else 0):
        pairs = [(t, j) for t in range(tokens) for j in range(k) if experts[t, j] == e]
        if capacity_factor is not None:
            pairs.sort(key=lambda p: -weights[p])  # stable: ties stay in (t, j) order
        for p in pairs[cap:]:
            kept[p] = False
    return kept


def _close(got, want):
    got = np.asarray(got, np.float64)
    scale = max(float(np.abs(want).max(initial=0)), 1.0)
    return got.shape == want.shape and float(np.abs(got - want).max(initial=0)) <= 2e-5 * scale


def _experts_on_rows(comm, expert_x, per_expert, mine, xp):
    """expert_y = f_e(expert_x) for this rank's experts ``mine`` [L, H, H],
    in either layout: [rows, H] grouped by expert (``per_expert`` rows
    each) or a fixed capacity's [L, slots, H]."""
    if expert_x.ndim == 3:
        return xp.einsum("lsh,lhg->lsg", expert_x, mine)
    counts = np.asarray(per_expert).tolist()
    parts = [expert_x[start:start + n] @ mine[e] for e, (start, n)
             in enumerate(zip(np.cumsum([0] + counts[:-1]).tolist(), counts))]
    return xp.concat(parts)


def _run_core(comm, d, batch, mine, quantize, calls):
    """The NumPy core: (y, None, None, the handle, its rows per local expert)."""
    x, experts, weights, _ = batch
    options = dict(quantize=quantize, dequantize=quantize is not None)
    if calls == "async":
        expert_x, handle = d.dispatch_async(x, experts, weights, **options).wait()
    else:
        expert_x, handle = d.dispatch(x, experts, weights, **options)
    expert_y = _experts_on_rows(comm, expert_x, handle.tokens_per_expert, mine, np)
    y = d.combine_async(expert_y, handle).wait() if calls == "async" \
        else d.combine(expert_y, handle)
    return y, None, None, handle, np.asarray(handle.tokens_per_expert)


def _run_torch(comm, d, batch, mine, quantize, calls):
    """The torch binding, with autograd: (y, dx, d weights, the core's
    handle, the rows per local expert)."""
    x, experts, weights, probe = (torch.from_numpy(a) for a in batch)
    x.requires_grad_()
    weights.requires_grad_()
    options = dict(quantize=quantize, dequantize=quantize is not None)
    if calls == "async":
        expert_x, handle = d.dispatch_async(x, experts, weights, **options).wait()
    else:
        expert_x, handle = d.dispatch(x, experts, weights, **options)
    expert_y = _experts_on_rows(comm, expert_x, handle.tokens_per_expert,
                                torch.from_numpy(mine), torch)
    y = d.combine_async(expert_y, handle).wait() if calls == "async" \
        else d.combine(expert_y, handle)
    (y * probe).sum().backward()
    return (y.detach().numpy(), x.grad.numpy(), weights.grad.numpy(), handle.core,
            torch.as_tensor(handle.tokens_per_expert).numpy())


def _run_jax(comm, d, batch, mine, quantize, calls):
    """The JAX binding, dispatch, experts, combine and gradient in one
    jitted program: (y, dx, d weights, None, the rows per local expert)."""
    x, experts, weights, probe = batch
    options = dict(quantize=quantize, dequantize=quantize is not None)

    def loss(x, weights, experts):
        expert_x, handle = d.dispatch(x, experts, weights, **options)
        y = d.combine(jnp.einsum("lsh,lhg->lsg", expert_x, jnp.asarray(mine)), handle)
        return (y * jnp.asarray(probe)).sum(), (y, handle.tokens_per_expert)
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (y, per_expert)), (dx, dw) = step(jnp.asarray(x), jnp.asarray(weights),
                                          jnp.asarray(experts.astype(np.int32)))
    return np.asarray(y), np.asarray(dx), np.asarray(dw), None, np.asarray(per_expert)


RUN = {"numpy": _run_core, "torch": _run_torch, "jax": _run_jax}
DISPATCHER = {"numpy": lambda: moe.Dispatcher, "torch": lambda: torch_moe.Dispatcher,
              "jax": lambda: jax_moe.Dispatcher}


def _case_id(case):
    return "-".join(str(case[name]) for name in FACTORS)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_moe_matrix(world, case):
    """One case: the per-token loop's y, drops per expert (every assignment
    is received or counted as dropped; a repeated expert's each), the
    handles' rows per expert (the stats' per slot) and gradients, or the
    refusal the case must meet on every rank; pipelined cases run the
    chunks asked."""
    num_experts = 2 * world.size
    capacity_factor, fixed, quantize = MODES[case["mode"]]
    hierarchical, chunks = PATHS[case["path"]]
    batch = _routing(world, case["spread"], num_experts)
    x, experts, weights, probe = batch
    maps = _maps(num_experts)
    placement = placement_for(world, case["placement"], num_experts)
    mine = slot_maps(maps, placement, world.rank, world.size)
    refusal = _expected_refusal(case)
    Dispatcher = DISPATCHER[case["framework"]]()

    def make():
        limit = dict(max_tokens_per_rank=TOKENS) if fixed else {}
        return Dispatcher(world, num_experts, capacity_factor=capacity_factor,
                          hierarchical=hierarchical, pipeline_chunks=chunks,
                          placement=placement, **limit)
    if refusal is not None and refusal[2] == "init":
        raises_everywhere(refusal[0], make, match=refusal[1])
        return
    d = make()
    run = RUN[case["framework"]]
    calls = case["calls"]
    if refusal is not None and refusal[2] == "dispatch":
        raises_everywhere(refusal[0], lambda: run(world, d, batch, mine, quantize, calls),
                          match=refusal[1])
        return
    if refusal is not None:  # no async calls: refused, and the sync calls hold
        raises_everywhere(refusal[0], lambda: d.dispatch_async, match=refusal[1])
        calls = "sync"
    y, dx, dw, handle, per_expert = run(world, d, batch, mine, quantize, calls)
    # fixed-size layouts have room for C (the JAX one without C: T) per expert and rank
    room = TOKENS if fixed or case["framework"] == "jax" else None
    want_y, want_dx, want_dw, kept, dropped = _reference(x, experts, weights, probe, maps,
                                                         capacity_factor, quantize, room)
    stats = d.collect_stats() if handle is None or handle.stats is None else handle.stats
    kept, dropped = (world.allreduce(a) for a in (kept, dropped))
    assigned = world.allreduce(np.array([(experts >= 0).sum()]))[0]
    ok = (_close(y, want_y) and np.array_equal(stats.tokens_per_expert, kept)
          and np.array_equal(stats.dropped, dropped)
          and stats.tokens_per_expert.sum() + stats.dropped.sum() == assigned
          and np.array_equal(world.allgather(per_expert.astype(np.int64)),
                             stats.tokens_per_slot))
    if dx is not None:
        ok = ok and _close(dx, want_dx) and _close(dw, want_dw)
    if handle is not None and hierarchical:
        ok = ok and handle.route.chunks == chunks
    assert all_ranks(ok)


def test_the_matrix_covers_every_pair():
    """Every pair of factor values meets in some case, and every framework x
    mode x path; every pair but JAX's with two hops (refused) also meets in
    a case that runs and is compared with the reference."""
    assert covering.pairs_missed(ALL_CASES, FACTORS) == []
    assert len({(c["framework"], c["mode"], c["path"]) for c in ALL_CASES}) == 27
    assert all(case in ALL_CASES for case in CASES)
    runs = [c for c in ALL_CASES if _expected_refusal(c) is None
            or _expected_refusal(c)[2] == "async"]
    assert [pair for pair in covering.pairs_missed(runs, FACTORS)
            if not {("framework", "jax"), ("path", "two-hop")} <= set(pair)
            and not {("framework", "jax"), ("path", "pipelined")} <= set(pair)] == []


# -- a token naming an expert twice, through every path (issue 53) ----------------
REPEATS = 6  # tokens per rank


def _repeated_routing(comm, tight):
    """This rank's batch whose tokens name experts twice and three times:
    at most ``REPEATS`` choices of any expert, or (``tight``) 8 of one."""
    num_experts = 2 * comm.size
    c, a, b = ((2 * comm.rank + shift) % num_experts for shift in range(3))  # a, b elsewhere
    experts = np.array([[a, a, b], [b, b, b], [a, -1, a], [a, a, a] if tight else [c, a, -1],
                        [a, b, c], [b, c, c]], np.int64)
    rng = np.random.default_rng([53, comm.rank])
    x, probe = (rng.standard_normal((REPEATS, HIDDEN)).astype(np.float32) for _ in range(2))
    weights = (rng.random(experts.shape) + 0.1).astype(np.float32)
    return x, experts, weights, probe


# (Dispatcher options, framework, the room each expert has per rank: None or C)
REPEAT_PATHS = {
    "counted flat": (dict(), "numpy", None),
    "counted two-hop": (dict(hierarchical=True), "numpy", None),
    "counted torch": (dict(), "torch", None),
    "fixed low-latency": (dict(max_tokens_per_rank="C"), "numpy", "C"),
    "fixed per-destination": (dict(max_tokens_per_rank="C"), "numpy", "C"),
    "fixed two-hop": (dict(max_tokens_per_rank="C", hierarchical=True), "numpy", "C"),
    "fixed low-latency torch": (dict(max_tokens_per_rank="C"), "torch", "C"),
    "fixed jax": (dict(max_tokens_per_rank="C"), "jax", "C"),
}


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("placement", ["none", "replicated"])
@pytest.mark.parametrize("tight", [False, True], ids=["room", "tight"])
def test_repeated_experts_get_the_same_statistics_on_every_path(world, monkeypatch, tight,
                                                                placement):
    """One routing whose tokens name an expert twice or three times: every
    path equals the per-token loop that counts each choice an assignment
    (y, and in torch and JAX dx and d weights) and has the same statistics:
    kept and dropped per expert, nothing invalid, the handles' rows per
    expert. With room (C = 2T) nothing is dropped anywhere; ``tight`` (C =
    T, and 8 choices of one expert on each rank) the fixed-size layouts
    drop its latest 2 on each rank, the counted mode none; under a
    placement too (room per logical expert). JAX compiles for seconds, so
    it runs where it meets that rule (the matrix's "duplicates" spread
    has it with room, and its Dispatcher without C, whose room is T).
    Before issue 53 the low-latency layout counted a repeated expert once
    (12 sent, 8 kept, 0 dropped), and the per-destination layout dropped
    by arrival."""
    x, experts, weights, probe = batch = _repeated_routing(world, tight)
    num_experts = 2 * world.size
    capacity = REPEATS if tight else 2 * REPEATS
    maps = _maps(num_experts)
    placement = placement_for(world, placement, num_experts)
    mine = slot_maps(maps, placement, world.rank, world.size)
    seen = {}
    for name, (options, framework, room) in REPEAT_PATHS.items():
        if framework == "jax" and not tight:
            continue
        options = {key: capacity if value == "C" else value for key, value in options.items()}
        room = capacity if room == "C" else room
        with monkeypatch.context() as patch:
            if name == "fixed per-destination":  # as if the rows were too large for the other
                patch.setattr(lowlatency, "LOW_LATENCY_MOST_BYTES", 0)
            d = DISPATCHER[framework]()(world, num_experts, placement=placement, **options)
            y, dx, dw, handle, per_expert = RUN[framework](world, d, batch, mine, None, "sync")
        want_y, want_dx, want_dw, kept, dropped = _reference(x, experts, weights, probe, maps,
                                                             None, None, room)
        stats = d.collect_stats() if handle is None or handle.stats is None else handle.stats
        kept, dropped = (world.allreduce(a) for a in (kept, dropped))
        rows = world.allgather(per_expert.astype(np.int64))
        ok = (_close(y, want_y) and (dx is None or _close(dx, want_dx) and _close(dw, want_dw))
              and np.array_equal(stats.tokens_per_expert, kept)
              and np.array_equal(stats.dropped, dropped) and stats.invalid == 0
              and np.array_equal(rows, stats.tokens_per_slot))
        assert all_ranks(ok), name
        seen[name] = (stats.tokens_per_expert.tolist(), stats.dropped.tolist(), rows.tolist())
    sent = world.allreduce(np.array([(experts >= 0).sum()]))[0]
    counted = seen["counted flat"]
    fixed_size = [v for name, v in seen.items() if REPEAT_PATHS[name][2] is not None]
    ok = (sum(counted[0]) == sent and not any(counted[1])
          and all(v == counted for name, v in seen.items() if REPEAT_PATHS[name][2] is None))
    if tight:  # the fixed-size paths alike, each rank's latest 2 dropped
        ok = ok and all(v == fixed_size[0] for v in fixed_size) \
            and sum(fixed_size[0][1]) == 2 * world.size
    else:
        ok = ok and all(v == counted for v in fixed_size)
    assert all_ranks(ok), seen


# -- pipeline_chunks, one option of the three Dispatchers (issue 36) -------------
class _Exchanges:
    """Counts the variable-size exchanges a communicator posts."""

    def __init__(self, comm):
        self.count, self._post = 0, comm.alltoallv_async
        comm.alltoallv_async = self

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._post(*args, **kwargs)


def _torch_step(d, batch, fixed):
    """y, dx and d weights of one dispatch and combine through the torch
    Dispatcher ``d`` (f_e(x) = x * (e + 1): a row's result does not depend
    on where it sits, so any chunk count must give the same bits), with
    the chunks the route took and the exchanges its dispatch posted."""
    x, experts, weights, probe = (torch.from_numpy(a) for a in batch)
    x.requires_grad_()
    weights.requires_grad_()
    counter = _Exchanges(d.core.comm)
    try:
        expert_x, handle = d.dispatch(x, experts, weights)
    finally:
        del d.core.comm.alltoallv_async
    comm = d.core.comm
    local = d.core.local_experts
    scale = torch.arange(comm.rank * local + 1, (comm.rank + 1) * local + 1,
                         dtype=torch.float32)
    if fixed:
        expert_y = expert_x * scale[:, None, None]
    else:
        expert_y = expert_x * torch.repeat_interleave(
            scale, torch.as_tensor(handle.tokens_per_expert))[:, None]
    y = d.combine(expert_y, handle)
    (y * probe).sum().backward()
    return ([t.detach().numpy().tobytes() for t in (y, x.grad, weights.grad)],
            handle.core.route.chunks, counter.count)


@pytest.mark.parametrize("fixed", [False, True], ids=["counted", "fixed"])
def test_torch_pipeline_chunks_runs_that_many_chunks(world, fixed):
    """The torch Dispatcher with pipeline_chunks=4, given to the constructor
    or assigned, really cuts the two-hop dispatch into 4 chunks (its route
    and the 2 x 4 exchanges it posts: hop 1 and hop 2 of each chunk) and
    gives one exchange's y, dx and d weights bit for bit. Before, the
    constructor had no such option and an assignment was ignored (one
    chunk)."""
    num_experts = 2 * world.size
    batch = _routing(world, "random", num_experts)
    limit = dict(max_tokens_per_rank=TOKENS) if fixed else {}
    one = _torch_step(torch_moe.Dispatcher(world, num_experts, hierarchical=True,
                                           pipeline_chunks=1, **limit), batch, fixed)
    given = _torch_step(torch_moe.Dispatcher(world, num_experts, hierarchical=True,
                                             pipeline_chunks=4, **limit), batch, fixed)
    d = torch_moe.Dispatcher(world, num_experts, hierarchical=True, **limit)
    d.pipeline_chunks = 4
    assigned = _torch_step(d, batch, fixed)
    assert all_ranks(one[1:] == (1, 2) and given[1:] == (4, 8) and assigned[1:] == (4, 8)
                     and d.core.pipeline_chunks == 4
                     and given[0] == one[0] and assigned[0] == one[0]), (one[1:], given[1:],
                                                                           assigned[1:])


@pytest.mark.parametrize("kind", ["numpy", "torch", "jax"])
def test_pipeline_chunks_is_checked_and_agreed_alike(world, kind):
    """The same refusal, on every rank, of a bad count on one rank and of
    counts that differ between ranks, in all three constructors."""
    Dispatcher = DISPATCHER[kind]()
    two_hop = kind != "jax"
    bad = world.size - 1
    raises_everywhere(commlib.CollectiveMismatchError, lambda: Dispatcher(
        world, 2 * world.size, hierarchical=two_hop,
        pipeline_chunks=0 if world.rank == bad else 1),
        match=f"rank {bad}: pipeline_chunks must be a positive integer")
    first = None if kind == "jax" else 2  # JAX takes None or 1
    raises_everywhere(commlib.CollectiveMismatchError, lambda: Dispatcher(
        world, 2 * world.size, hierarchical=two_hop,
        pipeline_chunks=first if world.rank == 0 else 1), match="different arguments")


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_flat_dispatch_refuses_chunks_it_would_ignore(world, kind):
    """pipeline_chunks above 1 without two hops: refused by the constructor
    and, assigned later, by the next dispatch, on every rank."""
    Dispatcher = DISPATCHER[kind]()
    message = "flat dispatch (hierarchical=False) has one hop"
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(world, 2 * world.size, pipeline_chunks=4),
                      match=message)
    d = Dispatcher(world, 2 * world.size, pipeline_chunks=1)
    d.pipeline_chunks = 4
    x, experts, weights, _ = _routing(world, "random", 2 * world.size)
    if kind == "torch":
        x, experts, weights = (torch.from_numpy(a) for a in (x, experts, weights))
    raises_everywhere(commlib.CollectiveMismatchError, lambda: d.dispatch(x, experts, weights),
                      match=message)


def test_jax_refuses_pipelining_and_keeps_the_count_read_only(world):
    """The JAX Dispatcher has no two-hop path: pipeline_chunks above 1 is
    refused on every rank; None and 1 (one exchange, what it does) are
    accepted, and the attribute cannot be changed."""
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: jax_moe.Dispatcher(world, 2 * world.size, pipeline_chunks=4),
                      match="pipeline_chunks=4 is not available in the JAX Dispatcher")
    d = jax_moe.Dispatcher(world, 2 * world.size, pipeline_chunks=1)
    with pytest.raises(AttributeError):
        d.pipeline_chunks = 4
    assert all_ranks(d.pipeline_chunks == 1
                     and jax_moe.Dispatcher(world, 2 * world.size).pipeline_chunks is None)

