"""Block kernels and the merge in every framework, with one test body: the
built-in kernel each framework gets (torch's fused SDPA ops, the tiled
array-API kernel for NumPy and CuPy, the same compiled by XLA for JAX) and
the tiled kernel run in torch, forward and backward, against torch autograd
in float64 on the same block; outputs in the caller's framework."""

import numpy as np
import pytest

from commlib.kernels import TILED, kernel_for
from commlib.ring import merge

import arrayimpl
import requires
from attention_reference import reference_attention, torch_reference

requires.module("torch")
requires.module("jax")

TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
CASES = [pytest.param(p.values[0], dtype, id=f"{p.id}-{dtype}", marks=p.marks)
         for p in arrayimpl.params() for dtype in ("float32", "bfloat16", "float16")
         if not (p.id == "cupy" and dtype == "bfloat16")]


def _block(impl, dtype, kv_heads, seed=0, seq=40):
    rng = np.random.default_rng(seed)
    full = [rng.standard_normal((2, seq, h, 8)) for h in (4, kv_heads, kv_heads, 4)]
    native = [impl.asarray(x, dtype) for x in full]
    return native, [impl.to_numpy(x).astype(np.float64) for x in native]


def _close(impl, got, want, tol):
    got = impl.to_numpy(got).astype(np.float64)
    return got.shape == want.shape and np.abs(got - want).max() <= tol * max(1, np.abs(want).max())


@pytest.mark.parametrize("which", ["built-in", "tiled"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("impl, dtype", CASES)
def test_kernel_forward_and_backward(impl, dtype, kv_heads, causal, which):
    (q, k, v, dout), (rq, rk, rv, rdout) = _block(impl, dtype, kv_heads)
    kernel = kernel_for(q) if which == "built-in" else TILED
    out, lse = kernel.forward(q, k, v, causal, 8 ** -0.5)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, 8 ** -0.5)
    want_out, *want_grads = torch_reference(rq, rk, rv, rdout, causal)
    _, want_lse = reference_attention(rq, rk, rv, causal)
    tol = TOLERANCE[dtype]
    assert all(impl.is_native(x) for x in (out, lse, *grads))
    assert impl.dtype_name(lse) == "float32"
    assert _close(impl, out, want_out, tol) and _close(impl, lse, want_lse, tol)
    assert all(_close(impl, g, w, 4 * tol) for g, w in zip(grads, want_grads))


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_merge_of_two_key_blocks_is_attention_over_both(impl):
    (q, k, v, _), (rq, rk, rv, _) = _block(impl, "float32", 2, seed=1, seq=20)
    first = TILED.forward(q, k[:, :8], v[:, :8], False, 8 ** -0.5)
    second = TILED.forward(q, k[:, 8:], v[:, 8:], False, 8 ** -0.5)
    out, lse = merge(*first, *second)
    want_out, want_lse = reference_attention(rq, rk, rv, False)
    assert impl.is_native(out) and impl.is_native(lse)
    assert _close(impl, out, want_out, 2e-6) and _close(impl, lse, want_lse, 2e-6)
