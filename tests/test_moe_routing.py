"""commlib.moe routing and bias balancing, single process.

``route`` is checked against an independent reference of DeepSeek-V3's gate
written as a plain per-token loop in float64, and against Mixtral-style
"softmax over the top-k logits", which equals renormalised softmax top-k.
The full case matrix runs on NumPy; a representative set runs in every
framework (``arrayimpl``), bfloat16 logits included.
"""

import itertools

import numpy as np
import pytest

from commlib.moe.balance import BiasBalancer
from commlib.moe.routing import route

import arrayimpl
import requires

NUMPY = arrayimpl.IMPLS["numpy"]

# float32 routing and a float64 reference may order two scores differently
# when they are this close; such rows are compared only where that cannot matter
NEAR_TIE = 1e-5


def reference_gate(logits, k, score, bias, num_groups, topk_groups, normalize):
    """DeepSeek-V3's gate, one token at a time, in float64.

    Returns experts [T, k], weights [T, k], and per row two margins: the gap
    at the boundaries that decide the chosen *set* (k-th vs next expert,
    last kept vs first dropped group) and the smallest gap between adjacent
    chosen experts, which decides their *order*.
    """
    tokens, num_experts = logits.shape
    experts = np.zeros((tokens, k), dtype=np.int64)
    weights = np.zeros((tokens, k))
    set_margin = np.full(tokens, np.inf)
    order_margin = np.full(tokens, np.inf)
    for t in range(tokens):
        row = logits[t].astype(np.float64)
        if score == "softmax":
            affinity = np.exp(row - row.max())
            affinity /= affinity.sum()
        else:
            affinity = 1.0 / (1.0 + np.exp(-row))
        chooser = (affinity + (0.0 if bias is None else bias)).tolist()
        eligible = list(range(num_experts))
        boundaries = []
        if num_groups is not None:
            size = num_experts // num_groups
            top_per_group = max(1, k // topk_groups)
            group_score = [sum(sorted(chooser[g * size:(g + 1) * size],
                                      reverse=True)[:top_per_group])
                           for g in range(num_groups)]
            ranked_groups = sorted(range(num_groups), key=lambda g: (-group_score[g], g))
            kept = ranked_groups[:topk_groups]
            if topk_groups < num_groups:
                boundaries.append(group_score[kept[-1]] - group_score[ranked_groups[topk_groups]])
            eligible = [e for g in kept for e in range(g * size, (g + 1) * size)]
        ranked = sorted(eligible, key=lambda e: (-chooser[e], e))
        chosen = ranked[:k]
        if len(ranked) > k:
            boundaries.append(chooser[chosen[-1]] - chooser[ranked[k]])
        gaps = [chooser[a] - chooser[b] for a, b in zip(chosen, chosen[1:])]
        set_margin[t] = min(boundaries, default=np.inf)
        order_margin[t] = min(gaps, default=np.inf)
        picked = affinity[chosen]
        experts[t] = chosen
        weights[t] = picked / picked.sum() if normalize else picked
    return experts, weights, set_margin, order_margin


def softmax_topk_reference(logits, k):
    """Mixtral's form: the top-k logits, then a softmax over just those."""
    experts = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(logits.astype(np.float64), experts, axis=1)
    exp = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return experts, exp / exp.sum(axis=1, keepdims=True)


def index_dtype_name(impl):
    """int64, except JAX without x64 (whose integers are int32)."""
    if impl.framework == "jax":
        import jax
        return "int64" if jax.config.jax_enable_x64 else "int32"
    return "int64"


def assert_matches_reference(logits, k, score, bias, num_groups, topk_groups, normalize,
                             impl=NUMPY, dtype="float32", host_bias=False, router=route):
    """Same expert sets (and order) as the reference wherever the reference's
    decision is not a near-tie; same weights for those experts. ``logits``
    and ``bias`` go in as ``impl`` arrays (logits as ``dtype``; the bias
    stays NumPy with ``host_bias``, as the balancer hands it over); the
    reference sees the logits as rounded to ``dtype``. Returns how many rows
    were near-ties at a set boundary. ``router`` stands in for ``route``
    (the same function under ``jax.jit``, say)."""
    given = impl.asarray(logits, dtype)
    logits = impl.to_numpy(given).astype(np.float32)
    shift = bias if bias is None or host_bias else impl.asarray(bias)
    experts, weights = router(given, k, score=score, bias=shift, num_groups=num_groups,
                              topk_groups=topk_groups, normalize=normalize)
    assert impl.is_native(experts) and impl.is_native(weights)
    assert impl.dtype_name(experts) == index_dtype_name(impl)
    assert impl.dtype_name(weights) == "float32"
    experts, weights = impl.to_numpy(experts), impl.to_numpy(weights)
    assert experts.shape == weights.shape == (logits.shape[0], k)
    ref_experts, ref_weights, set_margin, order_margin = reference_gate(
        logits, k, score, bias, num_groups, topk_groups, normalize)
    case = dict(k=k, score=score, groups=num_groups, topk_groups=topk_groups,
                normalize=normalize, bias=bias is not None, shape=logits.shape)
    clear = set_margin > NEAR_TIE
    for t in np.flatnonzero(clear):
        got = dict(zip(experts[t].tolist(), weights[t].tolist()))
        want = dict(zip(ref_experts[t].tolist(), ref_weights[t].tolist()))
        assert got.keys() == want.keys(), \
            f"row {t}: experts {sorted(got)} != {sorted(want)} in {case}"
        np.testing.assert_allclose([got[e] for e in want], list(want.values()),
                                   rtol=1e-5, atol=1e-7, err_msg=f"row {t} in {case}")
    ordered = clear & (order_margin > NEAR_TIE)
    np.testing.assert_array_equal(experts[ordered], ref_experts[ordered], err_msg=str(case))
    return int((~clear).sum())


def group_options(num_experts, k):
    """(num_groups, topk_groups) pairs valid for this many experts and k."""
    options = [(None, None)]
    for groups in (4, 8):
        for topk_groups in sorted({1, 2, groups // 2, groups}):
            if num_experts % groups == 0 and k <= topk_groups * (num_experts // groups):
                options.append((groups, topk_groups))
    return options


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_route_matches_reference_gate(score):
    rng = np.random.default_rng(2412 if score == "softmax" else 19437)
    near_ties = rows = 0
    for tokens, num_experts, k in itertools.product((8, 16, 64), (8, 16, 64), (1, 2, 4, 8)):
        if k > num_experts:
            continue
        for num_groups, topk_groups in group_options(num_experts, k):
            logits = rng.standard_normal((tokens, num_experts)).astype(np.float32)
            # a bias on the scale of the affinities, so that it changes choices
            scale = 0.1 if score == "sigmoid" else 0.5 / num_experts
            bias = (scale * rng.standard_normal(num_experts)).astype(np.float32) \
                if rng.random() < 0.7 else None
            near_ties += assert_matches_reference(logits, k, score, bias, num_groups,
                                                  topk_groups, normalize=bool(rng.random() < 0.7))
            rows += tokens
    assert near_ties < 0.01 * rows


# k, score, (num_groups, topk_groups), bias (None, "framework", "host"), normalize
FRAMEWORK_CASES = [(2, "softmax", (None, None), "host", True),
                   (4, "sigmoid", (4, 2), "framework", True),
                   (3, "sigmoid", (None, None), None, False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", arrayimpl.params())
def test_route_in_every_framework(impl, dtype):
    """Computed in the logits' framework, returned there; bfloat16 logits
    route as their float32 values would."""
    rng = np.random.default_rng(2025)
    for k, score, (num_groups, topk_groups), bias, normalize in FRAMEWORK_CASES:
        logits = rng.standard_normal((32, 16)).astype(np.float32)
        shift = None if bias is None else (0.05 * rng.standard_normal(16)).astype(np.float32)
        assert assert_matches_reference(logits, k, score, shift, num_groups, topk_groups,
                                        normalize, impl, dtype, host_bias=bias == "host") < 2


def test_route_computes_in_torch(monkeypatch):
    """No torch tensor is turned into NumPy on the way: the old path
    (unwrap to NumPy, compute, wrap back) fails here."""
    torch = requires.module("torch")

    def refuse(*args, **kwargs):
        raise AssertionError("route converted a torch tensor to NumPy")
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    monkeypatch.setattr(torch.Tensor, "__array__", refuse)
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    experts, weights = route(logits, 4, score="sigmoid", bias=torch.zeros(16),
                             num_groups=4, topk_groups=2)
    assert experts.dtype == torch.int64 and weights.dtype == torch.float32


def test_deepseek_v3_configuration():
    """256 experts in 8 groups, 4 groups per token, 8 experts per token."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((48, 256)).astype(np.float32)
    bias = (0.05 * rng.standard_normal(256)).astype(np.float32)
    assert assert_matches_reference(logits, 8, "sigmoid", bias, 8, 4, True) < 3


# k, score, (num_groups, topk_groups), bias (None, "framework", "host"), normalize, experts
JIT_CASES = [(2, "softmax", (None, None), None, True, 16),
             (4, "sigmoid", (4, 2), "framework", True, 16),
             (3, "softmax", (8, 4), "host", False, 64),
             (8, "sigmoid", (8, 4), "framework", True, 256)]  # DeepSeek-V3


def _jitted(jax):
    """``route`` compiled with its settings static and the arrays traced."""
    compiled = jax.jit(route, static_argnames=("k", "score", "num_groups", "topk_groups",
                                               "normalize"))
    return lambda logits, k, **options: compiled(logits, k=k, **options)


@pytest.mark.quick_sample(2)  # softmax without groups, and DeepSeek-V3's
@pytest.mark.parametrize("case", JIT_CASES, ids=lambda c: f"{c[1]}-k{c[0]}-groups{c[2][0]}-"
                                                          f"bias{c[3]}-E{c[5]}")
def test_route_traces_under_jit(case):
    """Inside ``jax.jit`` (no host read of a traced value) route gives what
    it gives eagerly, bit for bit, and what the float64 reference gives."""
    jax = requires.module("jax")
    jnp = jax.numpy
    k, score, (num_groups, topk_groups), bias, normalize, num_experts = case
    rng = np.random.default_rng(2412)
    logits = rng.standard_normal((48, num_experts)).astype(np.float32)
    shift = None if bias is None else (0.05 * rng.standard_normal(num_experts)).astype(np.float32)
    options = dict(score=score, num_groups=num_groups, topk_groups=topk_groups,
                   normalize=normalize)
    given_bias = shift if bias in (None, "host") else jnp.asarray(shift)
    eager = route(jnp.asarray(logits), k, bias=given_bias, **options)
    jitted = _jitted(jax)(jnp.asarray(logits), k, bias=given_bias, **options)
    for a, b in zip(eager, jitted):
        assert isinstance(b, jax.Array) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert assert_matches_reference(logits, k, score, shift, num_groups, topk_groups,
                                    normalize, arrayimpl.IMPLS["jax"], host_bias=bias == "host",
                                    router=_jitted(jax)) < 2


def test_route_refuses_bad_input_under_jit():
    """Values are checked when the compiled program runs (JAX wraps the
    ValueError in its runtime error); shapes and settings while tracing."""
    jax = requires.module("jax")
    jnp = jax.numpy
    router = _jitted(jax)
    for logits, bias, message in [
            (_with([0, 3], [1, 5], [np.nan, np.inf]), None, "NaN or inf values in 2 of 4 rows"),
            (np.zeros((4, 16), np.float32), np.full(16, np.inf, np.float32),
             "bias has NaN or inf"),
            (np.zeros((4, 16), np.float32), jnp.full(16, np.nan), "bias has NaN or inf")]:
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            jax.block_until_ready(router(jnp.asarray(logits), 2, bias=bias))
    with pytest.raises(ValueError, match=r"bias must have shape \(16,\)"):
        router(jnp.zeros((4, 16)), 2, bias=jnp.zeros(8))
    with pytest.raises(ValueError, match="k must be an integer"):
        jax.jit(route)(jnp.zeros((4, 16)), 2)  # k traced: it sets shapes, so it must be static
    with pytest.raises(ValueError, match="k=17 .* choose k between 1 and 16"):
        router(jnp.zeros((4, 16)), 17)


def test_softmax_topk_equals_mixtral_form():
    rng = np.random.default_rng(4)
    for num_experts, k in [(8, 2), (16, 4), (64, 8), (64, 1)]:
        logits = (3 * rng.standard_normal((256, num_experts))).astype(np.float32)
        experts, weights = route(logits, k)
        ref_experts, ref_weights = softmax_topk_reference(logits, k)
        np.testing.assert_array_equal(experts, ref_experts)
        np.testing.assert_allclose(weights, ref_weights, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-6)


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_ties_go_to_the_lower_index(impl):
    def chosen(logits, k, **options):
        experts, weights = route(impl.asarray(np.array(logits, np.float32)), k, **options)
        return impl.to_numpy(experts), impl.to_numpy(weights)

    experts, weights = chosen(np.zeros((3, 8)), 3)
    np.testing.assert_array_equal(experts, [[0, 1, 2]] * 3)
    np.testing.assert_allclose(weights, 1 / 3)
    experts, _ = chosen([[1, 3, 3, 2, 3]], 2)
    np.testing.assert_array_equal(experts, [[1, 2]])
    # equal groups: the lower groups win, then the lower experts in them
    experts, _ = chosen(np.zeros((2, 16)), 4, score="sigmoid", num_groups=4, topk_groups=2)
    np.testing.assert_array_equal(experts, [[0, 1, 2, 3]] * 2)


def test_experts_sorted_by_biased_score():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((64, 32)).astype(np.float32)
    bias = (0.2 * rng.standard_normal(32)).astype(np.float32)
    experts, _ = route(logits, 6, score="sigmoid", bias=bias)
    biased = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    assert (np.diff(np.take_along_axis(biased, experts, axis=1), axis=1) <= 0).all()


def test_bias_changes_the_choice_not_the_weights():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0, 0, 0, 10], np.float32)
    experts, weights = route(logits, 2, score="sigmoid", bias=bias, normalize=False)
    np.testing.assert_array_equal(experts, [[3, 0]])
    np.testing.assert_allclose(weights, 1 / (1 + np.exp(-logits[:, [3, 0]])), rtol=1e-6)


def test_group_per_node_limits_the_nodes_a_token_reaches():
    nodes, num_experts = 8, 64
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((512, num_experts)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
    for score in ("softmax", "sigmoid"):
        experts, _ = route(logits, 8, score=score, bias=bias, num_groups=nodes, topk_groups=2)
        node_counts = [len(set(row)) for row in (experts // (num_experts // nodes)).tolist()]
        assert max(node_counts) <= 2
        unlimited, _ = route(logits, 8, score=score, bias=bias)
        assert max(len(set(row)) for row in (unlimited // 8).tolist()) > 2  # the limit does work


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_normalize_false_gives_raw_affinities(score):
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((32, 16)).astype(np.float32)
    experts, weights = route(logits, 4, score=score, normalize=False)
    x = logits.astype(np.float64)
    affinity = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True) if score == "softmax" \
        else 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(weights, np.take_along_axis(affinity, experts, axis=1), rtol=1e-5)
    assert (weights.sum(axis=1) < 1).all() if score == "softmax" else True


def test_normalized_weights_survive_underflowing_affinities():
    """sigmoid(-200) is 0 in float32: dividing by the sum would give NaN.
    (All affinities tie at 0, so the lowest experts are chosen.)"""
    logits = np.full((2, 8), -200, np.float32)
    logits[0, 0] = -199
    experts, weights = route(logits, 2, score="sigmoid")
    np.testing.assert_array_equal(experts, [[0, 1], [0, 1]])
    np.testing.assert_allclose(weights, [[np.e / (1 + np.e), 1 / (1 + np.e)], [0.5, 0.5]],
                               rtol=1e-6)


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_no_tokens(impl):
    experts, weights = route(impl.asarray(np.zeros((0, 8), np.float32)), 2, num_groups=4,
                             topk_groups=2)
    assert experts.shape == weights.shape == (0, 2) and impl.is_native(experts)


def _with(row, col, value):
    logits = np.zeros((4, 16), np.float32)
    logits[row, col] = value
    return logits


BAD_INPUTS = [
    (dict(logits=_with(1, 2, np.nan)), r"NaN or inf values in 1 of 4 rows"),
    (dict(logits=_with([0, 3], [1, 5], [np.inf, -np.inf])), r"NaN or inf values in 2 of 4 rows"),
    (dict(k=0), r"k=0 .* choose k between 1 and 16"),
    (dict(k=17), r"k=17 .* choose k between 1 and 16"),
    (dict(k=2.0), r"k must be an integer"),
    (dict(num_groups=3, topk_groups=1), r"num_groups=3 does not divide num_experts=16"),
    (dict(num_groups=0, topk_groups=1), r"num_groups=0 does not divide"),
    (dict(topk_groups=2), r"topk_groups=2 was given without num_groups"),
    (dict(num_groups=4), r"num_groups=4 was given without topk_groups"),
    (dict(num_groups=4, topk_groups=0), r"topk_groups=0 must be between 1 and num_groups=4"),
    (dict(num_groups=4, topk_groups=5), r"topk_groups=5 must be between 1 and num_groups=4"),
    (dict(k=6, num_groups=4, topk_groups=1), r"k=6 exceeds the 4 experts .* at least 2"),
    (dict(score="relu"), r"unknown score 'relu'; use one of 'softmax', 'sigmoid'"),
    (dict(bias=np.zeros(8, np.float32)), r"bias must have shape \(16,\).* got \(8,\)"),
    (dict(bias=np.zeros((1, 16), np.float32)), r"bias must have shape \(16,\)"),
    (dict(bias=np.full(16, np.nan, np.float32)), r"bias has NaN or inf"),
    (dict(logits=np.zeros(16, np.float32)), r"logits must be 2-D .* got shape \(16,\)"),
    (dict(logits=np.zeros((2, 4, 16), np.float32)), r"logits must be 2-D"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_a_clear_value_error(change, message):
    args = dict(logits=np.zeros((4, 16), np.float32), k=2)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        route(args.pop("logits"), args.pop("k"), **args)


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_nan_logits_are_refused_in_every_framework(impl):
    logits = impl.asarray(_with([0, 3], [1, 5], [np.nan, np.inf]), "bfloat16")
    with pytest.raises(ValueError, match=r"NaN or inf values in 2 of 4 rows"):
        route(logits, 2)


# ---------------------------------------------------------------- BiasBalancer

def test_balancer_evens_out_a_skewed_router():
    """DeepSeek-V3's setting: sigmoid affinities, 64 experts, 8 per token."""
    num_experts, k, tokens = 64, 8, 4096
    rng = np.random.default_rng(10)
    skew = np.linspace(-1, 1, num_experts, dtype=np.float32)  # hot experts at the top end
    # a few fixed batches, cycled: fresh-looking tokens without paying for
    # 300 draws of 4096 x 64 normals
    batches = [rng.standard_normal((tokens, num_experts), dtype=np.float32) + skew
               for _ in range(6)]
    # The logit skew of 1 moves the hottest expert's sigmoid affinity by
    # about 0.2, so the bias must travel about 0.2 in affinity units. At the
    # default 1e-3 a step that takes ~130 of the 300 steps, too little
    # margin for a test; 3e-3 gets there in ~45 and its +-3e-3 jitter is
    # still far below the load noise of 4096 tokens.
    balancer = BiasBalancer(num_experts, rate=3e-3)
    bias, ratios = balancer.bias.copy(), []
    for step in range(300):
        experts, _ = route(batches[step % len(batches)], k, score="sigmoid", bias=bias)
        load = np.bincount(experts.ravel(), minlength=num_experts)
        ratios.append(load.max() / load.mean())
        bias = balancer.update(load)
    print(f"max/mean load: start {ratios[0]:.2f}, end {ratios[-1]:.2f} "
          f"(worst of last 10: {max(ratios[-10:]):.2f})")
    assert ratios[0] >= 2.5
    assert max(ratios[-10:]) < 1.4


def test_balancer_update_rule():
    balancer = BiasBalancer(4, rate=0.5, recenter=False)
    np.testing.assert_array_equal(balancer.bias, np.zeros(4, np.float32))
    bias = balancer.update(np.array([1, 2, 3, 6]))  # mean 3: up, up, stay, down
    np.testing.assert_array_equal(bias, [0.5, 0.5, 0, -0.5])
    assert bias.dtype == np.float32
    bias[:] = 99  # a copy: the balancer's own bias is untouched
    np.testing.assert_array_equal(balancer.bias, [0.5, 0.5, 0, -0.5])

    centred = BiasBalancer(4, rate=0.5)
    bias = centred.update([1, 2, 3, 6])
    np.testing.assert_allclose(bias, [0.375, 0.375, -0.125, -0.625])
    assert abs(bias.mean()) < 1e-7
    assert BiasBalancer(3).rate == 1e-3


def test_balancer_sums_load_over_ranks():
    class TwoRanks:
        """Stands in for a Communicator whose other rank saw the mirror load."""

        def __init__(self):
            self.calls = []

        def agree(self, op, *facts, problem=None):
            self.calls.append(op)
            if problem is not None:
                raise problem

        def allreduce(self, x, op="sum"):
            self.calls.append(op)
            return x + x[::-1]

    comm = TwoRanks()
    bias = BiasBalancer(4, rate=1.0, recenter=False).update(np.array([5, 0, 0, 1]), comm=comm)
    assert comm.calls == ["moe.BiasBalancer.update", "sum"]
    np.testing.assert_array_equal(bias, [-1, 1, 1, -1])  # summed: [6, 0, 0, 6]


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_balancer_takes_load_from_any_framework(impl):
    bias = BiasBalancer(3, rate=1.0, recenter=False).update(impl.asarray(np.array([0, 3, 0])))
    assert isinstance(bias, np.ndarray)
    np.testing.assert_array_equal(bias, [1, -1, 1])


@pytest.mark.parametrize("args, message", [
    (dict(num_experts=0), r"num_experts must be at least 1"),
    (dict(num_experts=4.5), r"num_experts must be an integer"),
    (dict(num_experts=4, rate=0), r"rate must be a positive"),
    (dict(num_experts=4, rate=-1e-3), r"rate must be a positive"),
    (dict(num_experts=4, rate=float("nan")), r"rate must be a positive"),
])
def test_balancer_rejects_bad_settings(args, message):
    with pytest.raises(ValueError, match=message):
        BiasBalancer(**args)


@pytest.mark.parametrize("load, message", [
    (np.ones(3), r"load must have shape \(4,\).* got \(3,\)"),
    (np.ones((4, 1)), r"load must have shape \(4,\)"),
    (np.array([1, -1, 0, 0]), r"non-negative, finite"),
    (np.array([1, np.nan, 0, 0]), r"non-negative, finite"),
])
def test_balancer_rejects_bad_load(load, message):
    with pytest.raises(ValueError, match=message):
        BiasBalancer(4).update(load)
