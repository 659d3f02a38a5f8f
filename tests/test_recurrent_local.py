"""The local decomposition of the recurrent mixers (bindings.torch._recurrent):
a stretch run from a zero state, plus its readout and (transition, offset),
read with an incoming state, equals the mixer run from that state. Against
transformers' torch reference in float32 and a per-token loop (written here)
in float64, forward and backward, with gates near 0 and near 1, lengths not a
multiple of the chunk, and document resets. And JAX's Mamba2 time steps
(bindings.jax._recurrent) against torch's where bfloat16 puts them on
dt_limit's bounds: the same steps, and torch.clamp's gradient there."""

import numpy as np
import pytest

import requires

torch = requires.module("torch")
requires.module("transformers")

from recurrent_reference import delta_rule_loop, ssd_loop  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    torch_chunk_gated_delta_rule,
)

from commlib.bindings.torch._recurrent import (  # noqa: E402
    delta_rule_piece,
    discretized_dt,
    mamba2_piece,
)

LENGTH, CHUNK = 37, 16  # three chunks, the last one partial
GATES = {"mid": (-0.5, 0.5), "near_one": (-1e-4, 0.999), "near_zero": (-12.0, 1e-4)}


def _delta_inputs(dtype, gates, k_heads=2, v_heads=2, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    log_decay, rate = GATES[gates]
    # keys of norm about 1, as the delta rule needs without its l2norm (beta |k|^2 <= 2)
    q, k = r(1, LENGTH, k_heads, dk), r(1, LENGTH, k_heads, dk) * 0.8 / dk ** 0.5
    v = r(1, LENGTH, v_heads, dv)
    g = log_decay * (1 + 0.1 * r(1, LENGTH, v_heads).abs())
    beta = (rate * (1 + 0.05 * r(1, LENGTH, v_heads))).clamp(0, 1)
    state = r(1, v_heads, dk, dv)
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


def _delta_from_piece(q, k, v, g, beta, state, resets=(), l2norm=False):
    piece = delta_rule_piece(q, k, v, g, beta, chunk_size=CHUNK, resets=resets,
                             use_qk_l2norm_in_kernel=l2norm)
    state = state.to(piece.out.dtype)
    out = piece.out + torch.einsum("blhk,bhkv->blhv", piece.readout, state)
    return out, piece.transition @ state + piece.offset


def _grads(outputs, inputs, seed=1):
    """Gradients of a random projection of the outputs."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


def _assert_close(got, want, inputs, forward, backward):
    """Outputs within ``forward``, gradients of every input within ``backward``."""
    assert _max_error(got, want) < forward
    assert _max_error(_grads(got, inputs), _grads(want, inputs)) < backward


def _max_error(got, want):
    return max(float((a.detach().double() - b.detach().double()).abs().max())
               for a, b in zip(got, want))


@pytest.mark.parametrize("gates", sorted(GATES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_delta_rule_piece_equals_transformers_float32(gates, l2norm):
    inputs = _delta_inputs(torch.float32, gates, k_heads=1, v_heads=2)
    out, final = _delta_from_piece(*inputs, l2norm=l2norm)
    want, want_final = torch_chunk_gated_delta_rule(
        *inputs[:5], chunk_size=CHUNK, initial_state=inputs[5], output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm)
    _assert_close([out, final], [want, want_final], inputs, 1e-4, 1e-3)


@pytest.mark.parametrize("gates", sorted(GATES))
def test_delta_rule_piece_equals_token_loop_float64(gates):
    inputs = _delta_inputs(torch.float64, gates)
    got = _delta_from_piece(*inputs, l2norm=True)
    want = delta_rule_loop(*inputs, l2norm=True)
    assert got[0].dtype == torch.float64
    _assert_close(got, want, inputs, 1e-10, 1e-9)


@pytest.mark.parametrize("resets", [(0,), (5,), (16, 30), (0, 20, 36)])
def test_delta_rule_piece_resets_at_document_starts(resets):
    inputs = _delta_inputs(torch.float64, "mid")
    piece = delta_rule_piece(*inputs[:5], chunk_size=CHUNK, resets=resets)
    assert float(piece.transition.detach().abs().max()) == 0
    assert float(piece.readout[:, resets[0]:].detach().abs().max()) == 0
    got = _delta_from_piece(*inputs, resets=resets)
    want = delta_rule_loop(*inputs, resets=resets)
    _assert_close(got, want, inputs, 1e-10, 1e-9)


def test_delta_rule_piece_of_16_bit_inputs_computes_in_float32():
    inputs = [t.detach() for t in _delta_inputs(torch.float32, "mid")]
    half = [t.to(torch.bfloat16) for t in inputs]
    got = _delta_from_piece(*half)
    want = _delta_from_piece(*[t.float() for t in half])
    assert got[0].dtype == torch.float32
    assert _max_error(got, want) < 1e-5


# ---- Mamba2 ---------------------------------------------------------------------------------

DECAYS = {"mid": (0.0, 0.5), "near_one": (-9.0, 0.01), "near_zero": (3.0, 4.0)}


def _ssd_inputs(dtype, decays, heads=4, groups=2, head_dim=6, dstate=8, seed=0):
    """x, dt (before bias and softplus), A, B, C, D, dt_bias, state."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    bias, a = DECAYS[decays]
    x = r(1, LENGTH, heads, head_dim)
    dt = r(1, LENGTH, heads)
    A = -a * (1 + 0.1 * r(heads).abs())
    B, C = r(1, LENGTH, groups, dstate), r(1, LENGTH, groups, dstate)
    D, dt_bias = r(heads), bias + 0.1 * r(heads)
    state = r(1, heads, head_dim, dstate)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, dt_bias, state)]


def _ssd_from_piece(x, dt, A, B, C, D, dt_bias, state, resets=(), limit=(0.0, float("inf"))):
    steps = discretized_dt(dt, dt_bias, True, limit)
    piece = mamba2_piece(x, steps, A, B, C, chunk_size=CHUNK, resets=resets)
    y = piece.out + torch.einsum("blhn,bhpn->blhp", piece.readout, state.to(piece.out.dtype))
    y = y + D[:, None] * x
    return y, piece.transition[..., None, None] * state + piece.offset


@pytest.mark.parametrize("decays", sorted(DECAYS))
def test_mamba2_piece_equals_transformers_float32(decays):
    inputs = _ssd_inputs(torch.float32, decays)
    x, dt, A, B, C, D, dt_bias, state = inputs
    limit = (0.0, 50.0)
    got = _ssd_from_piece(*inputs, limit=limit)
    want = mamba2_chunk_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, initial_states=state,
                             dt_softplus=True, dt_limit=limit, return_final_states=True)
    _assert_close(got, want, inputs, 1e-4, 1e-3)


@pytest.mark.parametrize("decays", sorted(DECAYS))
def test_mamba2_piece_equals_token_loop_float64(decays):
    inputs = _ssd_inputs(torch.float64, decays)
    got = _ssd_from_piece(*inputs)
    want = ssd_loop(*inputs)
    assert got[0].dtype == torch.float64
    _assert_close(got, want, inputs, 1e-10, 1e-9)


@pytest.mark.parametrize("resets", [(0,), (5,), (16, 30), (0, 20, 36)])
def test_mamba2_piece_resets_at_document_starts(resets):
    inputs = _ssd_inputs(torch.float64, "mid")
    got = _ssd_from_piece(*inputs, resets=resets)
    want = ssd_loop(*inputs, resets=resets)
    _assert_close(got, want, inputs, 1e-10, 1e-9)


# ---- JAX's time steps at dt_limit's bounds (issue 47) ----------------------------------------

TIE_LIMIT, TIE_BIAS = (0.1, 0.9), (0.125, 0.0625)
# dt + dt_bias, (start, stop, step): every bfloat16 value whose step lands
# near a bound of TIE_LIMIT (bfloat16's softplus of -2.25 and 0.375 are its
# 0.1 and 0.9), and a few far below, inside and above
TIE_WINDOWS = {True: ((-2.375, -2.125, 2 ** -6), (0.3515625, 0.3984375, 2 ** -9),
                      (-5.0, 2.0, 1.0)),
               False: ((0.09375, 0.109375, 2 ** -11), (0.875, 0.921875, 2 ** -8),
                       (0.0, 1.5, 0.25))}


def _dt_near_the_bounds(softplus):
    """dt [1, l, heads] (float64, exact in bfloat16), each value of
    TIE_WINDOWS less each head's bias, the tokens shuffled; and dt_bias."""
    steps = torch.cat([torch.arange(*window, dtype=torch.float64)
                       for window in TIE_WINDOWS[softplus]])
    steps = steps[torch.randperm(len(steps), generator=torch.Generator().manual_seed(0))]
    dt = (steps[:, None] - torch.tensor(TIE_BIAS)).to(torch.bfloat16).double()
    return dt[None].numpy(), np.array(TIE_BIAS)


def _torch_steps(dt, bias, softplus):
    """torch's steps of bfloat16 dt and dt_bias, their gradients of a random
    projection (in float32), and how many steps lie on a bound."""
    project = torch.tensor(np.random.default_rng(4).standard_normal(dt.shape)).float()
    dt, bias = (torch.tensor(a, dtype=torch.bfloat16, requires_grad=True) for a in (dt, bias))
    steps = discretized_dt(dt, bias, softplus, TIE_LIMIT)
    grads = torch.autograd.grad((steps.float() * project).sum(), [dt, bias])
    unclamped = discretized_dt(dt, bias, softplus, (-float("inf"), float("inf")))
    ties = int(sum((unclamped == bound).sum() for bound in TIE_LIMIT))
    return steps.detach().float().numpy(), [g.float().numpy() for g in grads], ties, project.numpy()


def _relative(got, want):
    return float(np.abs(np.asarray(got, np.float32) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("softplus", [True, False])
def test_jax_time_steps_equal_torchs_at_the_bounds_in_bfloat16(softplus):
    """JAX's steps (bias, softplus, clamp to dt_limit) of bfloat16 dt are
    torch's, bit for bit, under jit (as the mixer runs), and so are their
    gradients where a step is on a bound: 1 (jnp.clip's is 0.5; a softplus
    in bfloat16, or one XLA leaves in float32, puts other steps there)."""
    requires.module("jax")
    import jax
    import jax.numpy as jnp

    from commlib.bindings.jax._recurrent import _discretized_dt

    dt, bias = _dt_near_the_bounds(softplus)
    want_steps, want, ties, project = _torch_steps(dt, bias, softplus)
    assert ties >= len(TIE_BIAS)

    def loss(dt, bias):
        steps = _discretized_dt(dt, bias, softplus, TIE_LIMIT)
        return (steps.astype(jnp.float32) * project).sum(), steps
    got, steps = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(
        *(jnp.asarray(a, jnp.bfloat16) for a in (dt, bias)))
    np.testing.assert_array_equal(np.asarray(steps, np.float32), want_steps)
    for g, w in zip(got, want):
        assert _relative(g, w) < 1e-2


def test_jax_mamba2_scan_gradient_equals_torchs_at_dt_limit_ties_in_bfloat16():
    """The whole JAX scan under jit against the torch one (one rank,
    bfloat16, dt_limit (0.1, 0.9), steps on its bounds): the gradients of
    x, dt, B, C and dt_bias agree."""
    requires.module("jax")
    import jax
    import jax.numpy as jnp

    import commlib
    import commlib.bindings.jax as cj
    import commlib.bindings.torch as ct

    dt, bias = _dt_near_the_bounds(True)
    assert _torch_steps(dt, bias, True)[2] >= len(TIE_BIAS)
    (_, length, heads), head_dim, dstate = dt.shape, 4, 8
    rng = np.random.default_rng(3)
    x, B, C, project = (rng.standard_normal(s) for s in ((1, length, heads, head_dim),
                                                         (1, length, 1, dstate),
                                                         (1, length, 1, dstate),
                                                         (1, length, heads, head_dim)))
    A, D = -np.linspace(0.5, 2.0, heads), np.linspace(-0.5, 0.5, heads)
    inputs = [x, dt, A, B, C, D, bias]
    differentiated = (0, 1, 3, 4, 6)  # x, dt, B, C, dt_bias
    comm = commlib.init()
    try:
        leaves = [torch.tensor(a, dtype=torch.bfloat16, requires_grad=True) for a in inputs]
        x, dt, A, B, C, D, bias = leaves
        y = ct.mamba2_scan(x, dt, A, B, C, comm, layout="contiguous", chunk_size=16, D=D,
                           dt_bias=bias, dt_softplus=True, dt_limit=TIE_LIMIT)
        want = torch.autograd.grad((y.float() * torch.tensor(project).float()).sum(),
                                   [leaves[i] for i in differentiated])

        def loss(x, dt, A, B, C, D, bias):
            y = cj.mamba2_scan(x, dt, A, B, C, comm, layout="contiguous", chunk_size=16, D=D,
                               dt_bias=bias, dt_softplus=True, dt_limit=TIE_LIMIT)
            return (y.astype(jnp.float32) * project.astype(np.float32)).sum()
        got = jax.jit(jax.grad(loss, argnums=differentiated))(  # eagerly 4x slower
            *(jnp.asarray(a, jnp.bfloat16) for a in inputs))
    finally:
        comm.free()
    errors = {name: _relative(g, w.float().numpy())
              for name, g, w in zip(("x", "dt", "B", "C", "dt_bias"), got, want)}
    assert max(errors.values()) < 2e-2, errors
