"""The local decomposition of the recurrent mixers (bindings.torch_recurrent):
a stretch run from a zero state, plus its readout and (transition, offset),
read with an incoming state, equals the mixer run from that state. Against
transformers' torch reference in float32 and a per-token loop (written here)
in float64, forward and backward, with gates near 0 and near 1, lengths not a
multiple of the chunk, and document resets."""

import pytest

import requires

torch = requires.module("torch")
requires.module("transformers")

from recurrent_reference import delta_rule_loop, ssd_loop  # noqa: E402
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    torch_chunk_gated_delta_rule,
)

from commlib.bindings.torch_recurrent import (  # noqa: E402
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
