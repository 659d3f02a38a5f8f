"""One MoE contract: the core (``commlib.moe``), torch and JAX Dispatchers
take the same options, refuse the same bad options and input with the same
message, hand back handles of one protocol (``moe.MoEHandle``) and combine
with ``combine(expert_y, handle)``. Each test body runs over the three, on
arrays of their framework, against a per-token reference in NumPy."""

import inspect

import numpy as np
import pytest

import commlib
import commlib.moe as moe
from commlib.moe.quantize import dequantize_fp8, quantize_fp8

import requires
from conftest import all_ranks, raises_everywhere

# one contract: the same checks and messages at any size
WORLD_SIZES = (2,)

KINDS = ["core", "torch", "jax"]


def _module(kind):
    if kind == "torch":
        return requires.module("commlib.bindings.torch")
    if kind == "jax":
        return requires.module("commlib.bindings.jax")
    return moe


def _as(kind, a):
    """A NumPy array as one of ``kind``'s framework."""
    if kind == "torch":
        return requires.module("torch").from_numpy(np.ascontiguousarray(a))
    if kind == "jax":
        return requires.module("jax").numpy.asarray(a)
    return a


def _numpy(a):
    return a.numpy() if hasattr(a, "numpy") and not isinstance(a, np.ndarray) \
        else np.asarray(a)


def _inputs(comm, tokens=6, hidden=256, k=2, experts=None):
    """This rank's x [T, H] float32, experts [T, k] int64 (distinct per
    token, some -1) and weights [T, k] float32."""
    experts = experts or 2 * comm.size
    rng = np.random.default_rng(40 + comm.rank)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int64)
    chosen[::4, -1] = -1
    weights = (rng.random((tokens, k)) + 0.1).astype(np.float32)
    return experts, x, chosen, weights


@pytest.mark.parametrize("method", ["__init__", "dispatch", "combine"])
def test_one_signature(method):
    """Same parameter names, kinds and defaults, shown by inspect."""
    def shape(kind):
        return [(p.name, p.kind, p.default) for p in
                inspect.signature(getattr(_module(kind).Dispatcher, method)).parameters.values()]
    assert shape("core") == shape("torch") == shape("jax")
    if method == "__init__":
        names = [name for name, _, _ in shape("torch")]
        assert names == ["self", "comm", "num_experts", "capacity_factor", "drop_policy",
                         "hierarchical", "max_tokens_per_rank", "pipeline_chunks", "placement"]


BAD_OPTIONS = [
    (dict(num_experts=0), "num_experts=0 must be a positive multiple of the world size"),
    (dict(drop_policy="random"), "unknown drop_policy 'random'; use one of probs, position"),
    (dict(capacity_factor=0), "capacity_factor must be positive (or None for no cap), got 0"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be a positive integer"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS, ids=[m[:30] for _, m in BAD_OPTIONS])
@pytest.mark.parametrize("kind", KINDS)
def test_same_refusals_of_options(comm, kind, options, message):
    Dispatcher = _module(kind).Dispatcher
    settings = dict(num_experts=comm.size)
    settings.update(options)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(comm, settings.pop("num_experts"), **settings),
                      match=message)


@pytest.mark.parametrize("kind", KINDS)
def test_no_option_is_accepted_and_ignored(comm, kind):
    """``keep`` (the JAX binding's old registry size) is gone everywhere."""
    with pytest.raises(TypeError, match="keep"):
        _module(kind).Dispatcher(comm, comm.size, keep=3)


def _bad_inputs(experts, x, chosen, weights):
    """(x, experts, weights, options, message) that one rank passes."""
    out_of_range = chosen.copy()
    out_of_range[1, 0] = experts
    return [
        (x, chosen.astype(np.float32), weights, {}, "experts must be integers, got float32"),
        (x, chosen, weights[:, :1], {},
         f"weights must have the shape of experts {chosen.shape}, got {(chosen.shape[0], 1)}"),
        (x, chosen[1:], weights[1:], {},
         f"experts must be [tokens, k] with {x.shape[0]} rows like x, got shape"),
        (x, out_of_range, weights, {},
         f"expert indices must lie in [-1, {experts}) (-1: no expert), got values from -1 to "
         f"{experts}"),
        (x, chosen, weights, dict(quantize="int4"), "unknown quantize='int4'; use None"),
        (x[:, None], chosen, weights, dict(quantize="fp8"),
         "quantize='fp8' takes x of shape [tokens, hidden], got"),
        (x[:, 0], chosen, weights, {},  # was a difference in "row shape ()"
         f"x must be [tokens, hidden] (a row per token; more trailing axes are one row's "
         f"shape), got shape ({x.shape[0]},)"),
    ]


@pytest.mark.parametrize("case", range(7))
@pytest.mark.parametrize("kind", KINDS)
def test_same_refusals_of_input(comm, kind, case):
    """The last rank passes the bad input; every rank raises its message."""
    experts, x, chosen, weights = _inputs(comm)
    dispatcher = _module(kind).Dispatcher(comm, experts)
    bad_x, bad_experts, bad_weights, options, message = _bad_inputs(experts, x, chosen,
                                                                    weights)[case]
    bad = comm.size - 1
    given = (bad_x, bad_experts, bad_weights) if comm.rank == bad else (x, chosen, weights)
    if comm.rank != bad and options.get("quantize") == "int4":
        options = dict(quantize=None)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: dispatcher.dispatch(*(_as(kind, a) for a in given), **options),
                      match=f"rank {bad}: {message}")


@pytest.mark.parametrize("kind", KINDS)
def test_same_refusal_of_a_wrong_expert_y(comm, kind):
    experts, x, chosen, weights = _inputs(comm)
    dispatcher = _module(kind).Dispatcher(comm, experts, max_tokens_per_rank=6)
    expert_x, handle = dispatcher.dispatch(*(_as(kind, a) for a in (x, chosen, weights)))
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: dispatcher.combine(expert_x[:, 1:], handle),
                      match="expert_y must have one row per expert_x row (leading shape")


def _reference(comm, x, chosen, weights, experts, capacity_factor, factors):
    """y[t] = sum_j w[t, j] * factors[e] * x[t] over the kept choices: per
    expert, the ceil(T k / E cf) heaviest of this rank's choices, ties to
    the earlier (token, choice)."""
    kept = chosen >= 0
    if capacity_factor is not None:
        cap = int(np.ceil(chosen.size / experts * capacity_factor))
        kept = np.zeros(chosen.shape, bool)
        for e in range(experts):
            pairs = sorted(zip(*np.nonzero(chosen == e)), key=lambda p: -weights[p])
            for pair in pairs[:cap]:
                kept[pair] = True
    gain = np.where(kept, weights * factors[np.maximum(chosen, 0)], 0.0)
    return x * gain.sum(axis=1, keepdims=True), int((~kept & (chosen >= 0)).sum())


def _run_experts(expert_x, handle, factors, comm):
    """expert_y = factors[e] * expert_x for this rank's local experts, in
    either layout: [rows, H] grouped by expert, or [L, slots, H]."""
    local = factors.shape[0] // comm.size
    mine = factors[comm.rank * local:(comm.rank + 1) * local]
    if expert_x.ndim == 3:
        return expert_x * _as_like(expert_x, mine[:, None, None])
    counts = _numpy(handle.tokens_per_expert)
    return expert_x * _as_like(expert_x, np.repeat(mine, counts)[:, None])


def _as_like(like, a):
    kind = "torch" if type(like).__module__.startswith("torch") else \
        "jax" if "jax" in type(like).__module__ else "core"
    return _as(kind, a.astype(np.float32))


OPTIONS = [dict(), dict(capacity_factor=0.5), dict(max_tokens_per_rank=7),
           dict(max_tokens_per_rank=7, capacity_factor=0.5),
           dict(max_tokens_per_rank=7, quantize="fp8")]


@pytest.mark.quick_sample(5)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "counted")
@pytest.mark.parametrize("kind", KINDS)
def test_same_options_same_result(comm, kind, options):
    """Every option works in every Dispatcher and gives the per-token sum;
    FP8 rows (dequantized on arrival) give the sum over the rows as FP8
    rounds them, exactly; the handle follows the one protocol."""
    options = dict(options)
    quantize = options.pop("quantize", None)
    experts, x, chosen, weights = _inputs(comm)
    factors = 1.0 + np.arange(experts, dtype=np.float32)
    dispatcher = _module(kind).Dispatcher(comm, experts, **options)
    expert_x, handle = dispatcher.dispatch(*(_as(kind, a) for a in (x, chosen, weights)),
                                           quantize=quantize, dequantize=quantize is not None)
    y = _numpy(dispatcher.combine(_run_experts(expert_x, handle, factors, comm), handle))
    rows = x if quantize is None else dequantize_fp8(*quantize_fp8(x), np.float32)
    want, dropped = _reference(comm, rows, chosen, weights, experts,
                               options.get("capacity_factor"), factors)
    stats = dispatcher.collect_stats() if handle.stats is None else handle.stats
    assert all_ranks(isinstance(handle, moe.MoEHandle)
                     and np.allclose(y, want, rtol=1e-6, atol=1e-6)
                     and stats.dropped.sum() == comm.allreduce(np.array([dropped]))[0])
