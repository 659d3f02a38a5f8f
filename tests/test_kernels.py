"""Block kernels and the merge in every framework, with one test body: the
built-in kernel each framework gets (torch's fused SDPA ops, the tiled
array-API kernel for NumPy and CuPy, the same compiled by XLA for JAX) and
the tiled kernel run in torch, forward and backward, against torch autograd
in float64 on the same block; outputs in the caller's framework."""

import numpy as np
import pytest

from commlib.kernels import TILED, Kernel, capped, kernel_for
from commlib.ring import merge

import arrayimpl
import requires
from attention_reference import (
    document_mask,
    eager_reference,
    reference_attention,
    torch_reference,
)

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


@pytest.mark.quick_sample(24)  # of 72 on the host: each framework, dtype and option
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


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("hidden", ["causal", "mask", "none"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_few_queries_over_many_keys_are_attention(dtype, hidden, queries):
    """Decode's shapes on the CPU (a few queries, many keys, a KV head for
    two query heads, V narrower than K: multi-head latent attention's
    absorbed form has one for all), which torch's kernel hands to the
    tiled kernel (a causal block, a square elsewhere, stays with the fused
    kernel): out and lse of softmax attention, top-left causal, a row the
    mask hides wholly giving lse -inf and out 0."""
    torch = requires.module("torch")
    from commlib.kernels import torch_sdpa
    keys = torch_sdpa.MANY_KEYS
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(shape) for shape in
               ((2, queries, 4, 12), (2, keys, 2, 12), (2, keys, 2, 8)))
    mask = rng.random((queries, keys)) < 0.5 if hidden == "mask" else None
    if mask is not None:
        mask[0] = False
    visible = np.tril(np.ones((queries, keys), bool)) if hidden == "causal" else mask
    k_of_head, v_of_head = (np.repeat(x, 2, axis=2) for x in (k, v))  # query head i: kv i // 2
    scores = np.einsum("bthd,bnhd->bhtn", q, k_of_head) * 0.3
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        want_lse = np.log(np.exp(scores).sum(axis=-1))
        want = np.nan_to_num(np.einsum("bhtn,bnhv->bthv", np.exp(scores - want_lse[..., None]),
                                       v_of_head))
    to = lambda x: torch.tensor(x, dtype=getattr(torch, dtype))  # noqa: E731
    assert torch_sdpa._few(to(q), to(k), hidden == "causal") == (hidden != "causal")
    out, lse = torch_sdpa.forward(to(q), to(k), to(v), hidden == "causal", 0.3,
                                  mask=None if mask is None else torch.tensor(mask))
    tol = TOLERANCE.get(dtype, 1e-12)
    assert np.array_equal(np.isinf(lse.numpy()), np.isinf(want_lse))
    assert _close(arrayimpl.IMPLS["torch"], out, want, tol)
    assert _close(arrayimpl.IMPLS["torch"], torch.nan_to_num(lse, neginf=0.0),
                  np.where(np.isinf(want_lse), 0.0, want_lse), tol)


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_merge_of_two_key_blocks_is_attention_over_both(impl):
    (q, k, v, _), (rq, rk, rv, _) = _block(impl, "float32", 2, seed=1, seq=20)
    first = TILED.forward(q, k[:, :8], v[:, :8], False, 8 ** -0.5)
    second = TILED.forward(q, k[:, 8:], v[:, 8:], False, 8 ** -0.5)
    out, lse = merge(*first, *second)
    want_out, want_lse = reference_attention(rq, rk, rv, False)
    assert impl.is_native(out) and impl.is_native(lse)
    assert _close(impl, out, want_out, 2e-6) and _close(impl, lse, want_lse, 2e-6)


@pytest.mark.parametrize("impl", arrayimpl.params())
def test_merge_all_of_key_blocks_is_attention_over_them(impl):
    """Three blocks merged in one pass, one of them seeing no key for a row
    (lse -inf, out 0, as the decode paths pack it), and a row that no block
    sees (lse -inf and out 0 after the merge, never NaN)."""
    from commlib.kernels.merge import merge_all

    (q, k, v, _), (rq, rk, rv, _) = _block(impl, "float32", 2, seed=2, seq=24)
    parts = [TILED.forward(q, k[:, a:b], v[:, a:b], False, 8 ** -0.5)
             for a, b in ((0, 5), (5, 16), (16, 24))]
    outs = np.stack([impl.to_numpy(out) for out, _ in parts])
    lses = np.stack([impl.to_numpy(lse) for _, lse in parts])
    outs[1, :, 3] = 0.0  # block 1 saw no key for query 3
    lses[1, :, :, 3] = -np.inf
    lses[:, :, :, 7] = -np.inf  # no block saw a key for query 7
    out, lse = merge_all(impl.asarray(outs), impl.asarray(lses))
    mask = np.ones((24, 24), bool)
    mask[3, 5:16] = False
    scores = np.einsum("bshd,bthd->bhst", rq, np.repeat(rk, 2, axis=2)) * 8 ** -0.5
    scores = np.where(mask, scores, -np.inf)
    want_lse = np.log(np.exp(scores).sum(-1))
    want_out = np.einsum("bhst,bthd->bshd", np.exp(scores - want_lse[..., None]),
                         np.repeat(rv, 2, axis=2))
    want_lse[:, :, 7], want_out[:, 7] = -np.inf, 0.0
    got_out, got_lse = impl.to_numpy(out), impl.to_numpy(lse)
    assert impl.is_native(out) and impl.is_native(lse)
    assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
    finite = np.isfinite(want_lse)
    assert np.allclose(got_lse[finite], want_lse[finite], atol=2e-5)
    assert np.allclose(got_out, want_out, atol=2e-5)


@pytest.mark.parametrize("masking", ["causal", "window", "documents"])
@pytest.mark.parametrize("impl", arrayimpl.params(("numpy", "torch", "jax")))
def test_soft_capped_kernel_is_the_eager_capped_softmax(impl, masking):
    """The tiled kernel with a cap, float64, against the eager reference
    written out (scores, tanh cap, mask, softmax), output and gradients
    within 1e-10; scores large enough that the cap bends them."""
    import jax

    rng = np.random.default_rng(3)
    full = [rng.standard_normal((2, 24, h, 8)) * 2 for h in (4, 2, 2, 4)]
    mask = document_mask(24, [0, 7, 24] if masking == "documents" else None,
                         causal=True, window=(4, 0) if masking == "window" else None)
    with jax.enable_x64(True):
        q, k, v, dout = (impl.asarray(x, "float64") for x in full)
        kernel = capped(kernel_for(q, softcap=2.5), 2.5)
        assert kernel.takes_softcap is False and kernel.name.endswith("+softcap")
        dense = impl.asarray(mask)
        out, lse = kernel.forward(q, k, v, False, 0.5, mask=dense)
        grads = kernel.backward(dout, q, k, v, out, lse, False, 0.5, mask=dense)
        got = [impl.to_numpy(x).astype(np.float64) for x in (out, *grads)]
    want = eager_reference(*full, mask, softcap=2.5, scale=0.5)
    uncapped = eager_reference(*full, mask, scale=0.5)
    assert np.abs(uncapped[0] - want[0]).max() > 1e-2  # the cap matters here
    for g, w in zip(got, want):
        assert g.shape == w.shape and np.abs(g - w).max() <= 1e-10 * max(1, np.abs(w).max())


def test_kernel_for_a_cap_is_one_that_caps_and_a_kernel_that_cannot_is_refused():
    import torch

    q = torch.zeros(1, 4, 2, 8)
    assert kernel_for(q).takes_softcap is False  # torch's fused SDPA ops
    assert kernel_for(q, softcap=30.0) is TILED
    assert capped(TILED, None) is TILED and capped(TILED, 30.0) is capped(TILED, 30.0)
    fused = Kernel(TILED.forward, TILED.backward, "fused")
    with pytest.raises(ValueError, match="cannot cap the scores"):
        capped(fused, 30.0)
