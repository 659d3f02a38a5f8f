"""torch.compile and jax.jit over commlib's ops: the torch ops (ring,
Ulysses and hybrid attention in every layout and mask, sinks, the Ulysses
relayouts) trace with no graph break, forward and backward; compiled equals
eager; and ten calls with fresh but equal masks and new values of the same
shapes compile once. The torch MoE dispatch/combine ops compile whole
under a fixed capacity (the counted dispatch: one break). A jitted JAX
attention step and MoE dispatch/combine trace once across ten calls.
transformers' decoder blocks and whole models over these ops:
test_compile_models.py.

Backends: ``aot_eager`` (dynamo's graph, AOT autograd's forward and backward
graphs, run by the same kernels eager runs: compiled equals eager bitwise)
for most cases; inductor (its own fused kernels: within float32 rounding)
in the full tier, where its C++ compile time is affordable."""

import numpy as np
import pytest

from commlib import ring
from commlib.sequence.common_masks import block_diagonal, prefix_lm

import requires
from conftest import all_ranks

# an even and an odd ring (zigzag's chunk count, Ulysses' uneven heads); the
# hybrid's ulysses_size at 2 and 3 ranks is 1 or every rank (its 2 x 2 at 4
# ranks is test_bindings_torch's, and compiles through the same op)
WORLD_SIZES = (2, 3)

torch = requires.module("torch")
ct = requires.module("commlib.bindings.torch")
from compile_checks import (  # noqa: E402,F401 (fresh_dynamo: an autouse fixture)
    Counting,
    breaks,
    fresh_dynamo,
    identical,
    run,
)

SEQ, HEADS, KV_HEADS, DIM = 24, 6, 3, 8  # 2P divides SEQ at 2 and 3 ranks
CALLS = 10


# -- the ops alone -------------------------------------------------------------------

DOCUMENTS = [0, 5, 13, SEQ]


def _maskings():
    """name -> (layout, fresh options): each call makes new but equal
    objects (a new offsets tensor, a new Mask), as a training loop that
    builds them per batch does."""
    return {
        "causal": ("zigzag", lambda: dict(causal=True)),
        "cu_seqlens": ("zigzag", lambda: dict(causal=True,
                                              cu_seqlens=torch.tensor(DOCUMENTS))),
        "window": ("contiguous", lambda: dict(causal=True, window=(5, 0))),
        "mask": ("balanced", lambda: dict(causal=False, mask=prefix_lm(SEQ, 8))),
        "documents-mask": ("balanced", lambda: dict(causal=False,
                                                    mask=block_diagonal(SEQ, 4, causal=True))),
        # attention sinks, a learned parameter: their gradient is in the backward graph
        "sinks": ("zigzag", lambda: dict(causal=True, sinks=torch.linspace(
            -1.0, 2.0, HEADS).requires_grad_())),
        # Gemma2's cap on the scores: an option the op carries in its schema
        "softcap": ("zigzag", lambda: dict(causal=True, softcap=1.5)),
    }


def _attend(comm, algorithm):
    if algorithm == "ring":
        return lambda q, k, v, **o: ct.ring_attention(q, k, v, comm, **o)
    if algorithm == "ulysses":
        return lambda q, k, v, **o: ct.ulysses_attention(q, k, v, comm, **o)
    degree = 1 if algorithm == "hybrid-ring" else comm.size  # a ring of 1-rank groups, or one group
    return lambda q, k, v, **o: ct.hybrid_attention(q, k, v, comm, degree, **o)


def _shards(comm, layout, options, seed):
    """q, k, v and a loss probe: this rank's shards of seeded global tensors."""
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(1, SEQ, h, DIM, generator=gen)
            for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    placed = {key: options[key] for key in ("cu_seqlens", "mask") if key in options}
    if "cu_seqlens" in placed:
        placed["cu_seqlens"] = DOCUMENTS
    return [ring.shard_sequence(x, comm, layout=layout, **placed) for x in full]


ATTENTION_CASES = [("ring", masking) for masking in _maskings()] + [
    ("ulysses", "causal"), ("ulysses", "cu_seqlens"), ("ulysses", "window"),
    ("ulysses", "mask"), ("ulysses", "sinks"), ("hybrid-ring", "causal"),
    ("hybrid-ring", "documents-mask"), ("hybrid-ulysses", "cu_seqlens"),
    ("hybrid-ulysses", "window"), ("ulysses", "softcap"), ("hybrid-ulysses", "softcap")]


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("algorithm, masking", ATTENTION_CASES)
def test_attention_compiles_whole_once_and_equals_eager(comm, algorithm, masking):
    """No graph break (forward; the backward is AOT autograd's graph of the
    op's backward op, run here); compiled loss and gradients equal eager's
    bitwise; ten calls, each with a fresh equal mask (or new offsets tensor)
    and new values, compile once."""
    layout, options = _maskings()[masking]
    attend = _attend(comm, algorithm)

    def step(q, k, v, probe, settings):
        return (attend(q, k, v, layout=layout, **settings) * probe).sum()

    count, reasons = breaks(step, *_shards(comm, layout, options(), 0), options())
    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    same = []
    for call in range(CALLS):
        *inputs, probe = _shards(comm, layout, options(), call)
        same.append(identical(run(compiled, inputs, probe, options()),
                              run(step, inputs, probe, options())))
    assert all_ranks(count == 0), reasons
    assert all_ranks(all(same)), same
    assert all_ranks(counting.graphs == 1), f"{counting.graphs} graphs for {CALLS} calls"


def test_another_mask_is_another_graph_not_a_stale_one(comm):
    """The graph is specialised on the mask's name: a mask of other content
    retraces (and gives that mask's attention), an equal one does not."""
    attend = _attend(comm, "ring")

    def step(q, k, v, probe, mask):
        return (attend(q, k, v, layout="contiguous", causal=False, mask=mask) * probe).sum()

    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    *inputs, probe = _shards(comm, "contiguous", {}, 1)
    results = []
    for prefix in (8, 8, 16, 16, 8):
        mask = prefix_lm(SEQ, prefix)
        results.append(identical(run(compiled, inputs, probe, mask),
                                 run(step, inputs, probe, mask)))
    first, other = run(step, inputs, probe, prefix_lm(SEQ, 8)), \
        run(step, inputs, probe, prefix_lm(SEQ, 16))
    # the masks differ in what they give (on some rank: the last one's queries see alike)
    assert not all_ranks(torch.equal(first[0], other[0]))
    assert all_ranks(all(results)), results
    assert all_ranks(counting.graphs == 2), f"{counting.graphs} graphs for 2 masks"


@pytest.mark.parametrize("heads, num_heads", [(HEADS, None), (KV_HEADS, HEADS)],
                         ids=["query", "kv"])
def test_relayouts_compile_whole_once_and_equal_eager(comm, heads, num_heads):
    """seq_to_head, a pointwise op, head_to_seq (each the other's backward);
    kv: the kv heads of a GQA model, laid out for its query heads (split
    unevenly, or replicated, where the ranks outnumber them)."""
    def step(x, probe):
        heads = ct.seq_to_head(x, comm, num_heads)
        back = ct.head_to_seq(heads.sin(), comm, x.shape[2], num_heads)
        return (back * probe).sum()

    def inputs(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randn(2, SEQ // comm.size, heads, DIM, generator=gen) for _ in range(2)]

    count, reasons = breaks(step, *inputs(0))
    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    same = [identical(run(compiled, [x], probe), run(step, [x], probe))
            for x, probe in (inputs(call) for call in range(CALLS))]
    assert all_ranks(count == 0), reasons
    assert all_ranks(all(same)), same
    assert all_ranks(counting.graphs == 1), f"{counting.graphs} graphs for {CALLS} calls"


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_the_fp8_wire_compiles_whole_once_and_equals_eager(comm, with_sinks):
    """Ulysses with ``wire="float8"`` (forward only: under no_grad), with
    sinks or without: one op, no graph break, one graph for every call,
    compiled equal to eager bitwise."""
    sinks = torch.linspace(-1.0, 2.0, HEADS) if with_sinks else None

    def step(q, k, v):
        return ct.ulysses_attention(q, k, v, comm, layout="zigzag", causal=True, sinks=sinks,
                                    wire="float8")

    with torch.no_grad():
        count, reasons = breaks(step, *_shards(comm, "zigzag", {}, 0)[:3])
        counting = Counting()
        compiled = torch.compile(step, backend=counting, fullgraph=True)
        same = [torch.equal(compiled(*qkv), step(*qkv))
                for qkv in (_shards(comm, "zigzag", {}, call)[:3] for call in range(3))]
    assert all_ranks(count == 0), reasons
    assert all_ranks(all(same)), same
    assert all_ranks(counting.graphs == 1), f"{counting.graphs} graphs for 3 calls"


@pytest.mark.full
@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_inductor_equals_eager_within_float32_rounding(comm, algorithm):
    """Inductor's own kernels around the op (the op itself is not traced
    into): loss and gradients within float32 rounding of eager's."""
    layout, options = _maskings()["cu_seqlens"]
    attend = _attend(comm, algorithm)

    def step(q, k, v, probe, settings):
        out = attend(q.sin(), k.cos(), v * 2, layout=layout, **settings)
        return (out.square() * probe).sum()

    compiled = torch.compile(step, fullgraph=True)
    *inputs, probe = _shards(comm, layout, options(), 3)
    (loss, grads), (want, want_grads) = (run(compiled, inputs, probe, options()),
                                        run(step, inputs, probe, options()))
    errors = [float((a - b).abs().max()) / float(b.abs().max())
              for a, b in zip([loss, *grads], [want, *want_grads])]
    assert all_ranks(max(errors) <= 1e-4), errors  # the loss: a sum that cancels


# -- JAX: one trace for ten calls -------------------------------------------------------

jax = requires.module("jax")
jnp = jax.numpy
cj = requires.module("commlib.bindings.jax")


@pytest.mark.parametrize("kind", ["ring", "ulysses"])
def test_jitted_attention_step_traces_once(comm, kind):
    """A jitted value_and_grad step with a mask (static: a fresh equal Mask
    hashes and compares equal), ten calls with new values: one trace."""
    attend = {"ring": cj.ring_attention, "ulysses": cj.ulysses_attention}[kind]
    layout = "balanced" if kind == "ring" else "contiguous"
    traces = []

    def loss(q, k, v, probe, mask):
        traces.append(mask)
        out = attend(q, k, v, comm, layout=layout, causal=False, mask=mask)
        return (out * probe).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=4)
    finite = []
    for call in range(CALLS):
        mask = prefix_lm(SEQ, 8)
        rng = np.random.default_rng(call)
        shards = [jnp.asarray(ring.shard_sequence(
            rng.standard_normal((1, SEQ, h, DIM)).astype(np.float32), comm, layout=layout,
            mask=mask)) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
        value, grads = step(*shards, mask)
        finite.append(bool(np.isfinite(float(value))) and all(
            bool(np.isfinite(np.asarray(g)).all()) for g in grads))
    assert all_ranks(all(finite))
    assert all_ranks(len(traces) == 1 and step._cache_size() == 1), \
        f"{len(traces)} traces, {step._cache_size()} programs"


@pytest.mark.parametrize("capacity_factor", [None, 1.25], ids=["no-drops", "fixed-capacity"])
def test_jitted_moe_dispatch_combine_traces_once(comm, capacity_factor):
    """Dispatch, the experts, combine and their gradients in one jitted step;
    ten calls with new tokens and new routing (same shapes): one trace."""
    experts, tokens, hidden, k = 2 * comm.size, 12, 8, 2
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=capacity_factor)
    maps = jnp.asarray(np.random.default_rng(7).standard_normal(
        (dispatcher.local_experts, hidden, hidden)).astype(np.float32))
    traces = []

    def loss(x, chosen, weights, maps):
        traces.append(1)
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        y = dispatcher.combine(jnp.einsum("esh,ehg->esg", expert_x, maps), handle)
        return (y * y).sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))
    finite = []
    for call in range(CALLS):
        rng = np.random.default_rng(100 * call + comm.rank)
        x = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32))
        chosen = jnp.asarray(np.argsort(-rng.standard_normal((tokens, experts)),
                                        axis=1)[:, :k].astype(np.int32))
        weights = jnp.asarray(rng.random((tokens, k)).astype(np.float32) + 0.1)
        value, grads = step(x, chosen, weights, maps)
        finite.append(bool(np.isfinite(float(value))) and all(
            bool(np.isfinite(np.asarray(g)).all()) for g in grads))
    assert all_ranks(all(finite))
    assert all_ranks(len(traces) == 1 and step._cache_size() == 1), \
        f"{len(traces)} traces, {step._cache_size()} programs"


# -- torch MoE dispatch/combine as ops --------------------------------------------------

MOE_TOKENS, MOE_HIDDEN, MOE_K = 6, 8, 2


def _moe_step(dispatcher, maps, quantize=None):
    """A norm, dispatch, a per-expert map, combine: the loss of x, weights
    and maps (the norm first, so that a break at the dispatch has a graph
    before it, which ``explain`` counts)."""

    def step(x, weights, maps, chosen):
        expert_x, handle = dispatcher.dispatch(torch.nn.functional.rms_norm(x, x.shape[1:]),
                                               chosen, weights, quantize=quantize,
                                               dequantize=quantize is not None)
        if expert_x.ndim == 3:  # fixed capacity: [local experts, slots, H]
            expert_y = torch.tanh(torch.bmm(expert_x, maps))
        else:  # counted: every row through the first map
            expert_y = torch.tanh(expert_x @ maps[0])
        return dispatcher.combine(expert_y, handle).square().sum()
    return step


def _moe_inputs(comm, dispatcher, call):
    generator = torch.Generator().manual_seed(100 * call + comm.rank)
    x = torch.randn(MOE_TOKENS, MOE_HIDDEN, generator=generator)
    weights = torch.rand(MOE_TOKENS, MOE_K, generator=generator) + 0.1
    chosen = torch.argsort(torch.randn(MOE_TOKENS, dispatcher.core.num_experts,
                                       generator=generator), dim=1)[:, :MOE_K]
    return [x, weights], chosen


def _moe_maps(dispatcher):
    generator = torch.Generator().manual_seed(7)
    return torch.randn(dispatcher.core.local_experts, MOE_HIDDEN, MOE_HIDDEN,
                       generator=generator) / MOE_HIDDEN ** 0.5


@pytest.mark.parametrize("capacity_factor, hierarchical, quantize",
                         [(None, False, None), (1.5, False, None), (None, True, "fp8")])
def test_moe_fixed_capacity_compiles_whole_and_equals_eager(comm, capacity_factor, hierarchical,
                                                            quantize):
    """The fixed-capacity dispatch and combine (``commlib::moe_dispatch`` /
    ``moe_combine`` and their backward ops; flat, two-hop with FP8 rows
    dequantized): no graph break, the loss and
    the gradients of x, the weights and the experts' maps equal eager
    bitwise, and ten calls with new tokens and routing run one graph (the
    routing state travels as a key tensor made when the op runs, never a
    constant of the graph); no dispatch handle outlives its graph's use."""
    from commlib.bindings.torch import _moe as torch_moe
    dispatcher = ct.Dispatcher(comm, 2 * comm.size, max_tokens_per_rank=MOE_TOKENS,
                               capacity_factor=capacity_factor, hierarchical=hierarchical)
    maps = _moe_maps(dispatcher)
    step = _moe_step(dispatcher, maps, quantize)
    inputs, chosen = _moe_inputs(comm, dispatcher, 0)
    count, reasons = breaks(step, *inputs, maps, chosen)
    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    same = []
    for call in range(CALLS):
        inputs, chosen = _moe_inputs(comm, dispatcher, call)
        results = [run(function, inputs + [maps], chosen) for function in (compiled, step)]
        same.append(identical(*results))
    import gc
    gc.collect()
    assert all_ranks(count == 0), reasons
    assert all_ranks(all(same)), same
    assert all_ranks(counting.graphs == 1), f"{counting.graphs} graphs for {CALLS} calls"
    assert all_ranks(not torch_moe._held), f"{len(torch_moe._held)} dispatch handles kept"


def test_moe_fixed_capacity_under_inductor(comm):
    """Inductor's own kernels around the ops: within float32 rounding of
    eager, no break."""
    dispatcher = ct.Dispatcher(comm, 2 * comm.size, max_tokens_per_rank=MOE_TOKENS)
    maps = _moe_maps(dispatcher)
    step = _moe_step(dispatcher, maps)
    compiled = torch.compile(step, fullgraph=True)
    errors = []
    for call in range(2):
        inputs, chosen = _moe_inputs(comm, dispatcher, call)
        (loss_a, grads_a), (loss_b, grads_b) = [run(function, inputs + [maps], chosen)
                                                for function in (compiled, step)]
        errors.append(max([float((loss_a - loss_b).abs() / loss_b.abs())]
                          + [float((a - b).abs().max()) for a, b in zip(grads_a, grads_b)]))
    assert all_ranks(max(errors) <= 1e-5), errors


def test_moe_counted_dispatch_breaks_once(comm):
    """The counted dispatch's rows are known only after a host read: one
    graph break, at the dispatch (its combine and both backwards are ops),
    and compiled equals eager bitwise; with
    ``capture_dynamic_output_shape_ops`` the op is traced, its rows an
    unbacked size: no break, still equal."""
    dispatcher = ct.Dispatcher(comm, 2 * comm.size, capacity_factor=1.5)
    maps = _moe_maps(dispatcher)
    step = _moe_step(dispatcher, maps)
    counts, same = [], []
    for capture in (False, True):
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
            inputs, chosen = _moe_inputs(comm, dispatcher, 0)
            counts.append(breaks(step, *inputs, maps, chosen))
            compiled = torch.compile(step, backend=Counting())
            for call in range(3):
                inputs, chosen = _moe_inputs(comm, dispatcher, call)
                same.append(identical(*[run(function, inputs + [maps], chosen)
                                        for function in (compiled, step)]))
            torch._dynamo.reset()
    (eager_count, eager_reasons), (traced_count, traced_reasons) = counts
    assert all_ranks(eager_count == 1 and "disable" in eager_reasons[0].lower()), eager_reasons
    assert all_ranks(traced_count == 0), traced_reasons
    assert all_ranks(all(same)), same


def test_moe_micro_batches_in_flight_find_their_own_handles(comm):
    """Two dispatches in flight in one compiled step, combined in the other
    order (their backwards run in yet another): each combine and backward
    uses its own dispatch's routing (the key tensor, not a slot of the
    Dispatcher), so compiled equals eager bitwise, and equals two separate
    steps."""
    dispatcher = ct.Dispatcher(comm, 2 * comm.size, max_tokens_per_rank=MOE_TOKENS)
    maps = _moe_maps(dispatcher)
    single = _moe_step(dispatcher, maps)

    def pair(x_a, w_a, x_b, w_b, maps, chosen_a, chosen_b):
        ex_a, h_a = dispatcher.dispatch(x_a, chosen_a, w_a)
        ex_b, h_b = dispatcher.dispatch(x_b, chosen_b, w_b)
        y_b = dispatcher.combine(torch.tanh(torch.bmm(ex_b, maps)), h_b)
        y_a = dispatcher.combine(torch.tanh(torch.bmm(ex_a, maps)), h_a)
        return y_a.square().sum() + 2 * y_b.square().sum()

    def normed(x):
        return torch.nn.functional.rms_norm(x, x.shape[1:])
    (x_a, w_a), chosen_a = _moe_inputs(comm, dispatcher, 1)
    (x_b, w_b), chosen_b = _moe_inputs(comm, dispatcher, 2)
    compiled = torch.compile(pair, backend=Counting(), fullgraph=True)
    results = [run(function, [normed(x_a), w_a, normed(x_b), w_b, maps], chosen_a, chosen_b)
               for function in (compiled, pair)]
    loss_a, grads_a = run(single, [x_a, w_a, maps], chosen_a)
    loss_b, grads_b = run(single, [x_b, w_b, maps], chosen_b)
    (_, (_, gw_a, _, gw_b, _)) = results[0]
    assert all_ranks(identical(*results))
    assert all_ranks(torch.allclose(results[0][0], loss_a + 2 * loss_b, rtol=1e-6))
    assert all_ranks(torch.allclose(gw_a, grads_a[1], rtol=1e-5)
                     and torch.allclose(gw_b, 2 * grads_b[1], rtol=1e-5))
