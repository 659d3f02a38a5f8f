"""The pieces of Ring Attention that need no peers: the merge and the
blockwise kernel, against NumPy float64 full attention."""

import numpy as np
import pytest

from commlib.ring import attention_backward, attention_forward, merge
from commlib.sequence.layout import chunks_of

import requires
from attention_reference import reference_attention

torch = requires.module("torch")


def inputs(seq=37, heads=4, kv_heads=2, dim=8, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((2, seq, heads, dim)) * scale).astype(np.float32)
    k = (rng.standard_normal((2, seq, kv_heads, dim)) * scale).astype(np.float32)
    v = rng.standard_normal((2, seq, kv_heads, dim)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [5, 16, 512])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_kernel_forward(causal, tile, kv_heads):
    q, k, v = inputs(kv_heads=kv_heads)
    out, lse = attention_forward(q, k, v, causal, tile=tile)
    ref_out, ref_lse = reference_attention(q, k, v, causal)
    assert out.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [5, 512])
def test_kernel_backward_matches_autograd(causal, tile):
    q, k, v = inputs(kv_heads=2, seed=1)
    dout = np.random.default_rng(2).standard_normal(q.shape).astype(np.float32)
    out, lse = attention_forward(q, k, v, causal, tile=tile)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, causal, tile=tile)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64).transpose(1, 2).requires_grad_()
                  for x in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=causal, enable_gqa=True).backward(
        torch.tensor(dout, dtype=torch.float64).transpose(1, 2))
    for got, want in ((dq, tq), (dk, tk), (dv, tv)):
        np.testing.assert_allclose(got, want.grad.transpose(1, 2).numpy(), atol=1e-5)


def test_causal_kernel_needs_square_blocks():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="as many queries as keys"):
        attention_forward(q, k[:, :5], v[:, :5], causal=True)


def test_merge_of_two_key_blocks_is_attention_over_both():
    q, k, v = inputs(seq=20)
    first = attention_forward(q, k[:, :8], v[:, :8], False)
    second = attention_forward(q, k[:, 8:], v[:, 8:], False)
    out, lse = merge(*first, *second)
    ref_out, ref_lse = reference_attention(q, k, v, False)
    np.testing.assert_allclose(out, ref_out, atol=2e-6)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)


def test_merge_handles_empty_and_extreme_sides():
    out = np.ones((1, 3, 1, 2), np.float32)
    block = np.full((1, 3, 1, 2), 5.0, np.float32)
    lse = np.array([[[-np.inf, -np.inf, 1e30]]], np.float32)
    block_lse = np.array([[[-np.inf, 0.0, -1e30]]], np.float32)
    merged, merged_lse = merge(out, lse, block, block_lse)
    assert not np.isnan(merged).any() and not np.isnan(merged_lse).any()
    assert merged_lse[0, 0, 0] == -np.inf and (merged[0, 0] == 0).all()  # both empty
    assert merged_lse[0, 0, 1] == 0.0 and (merged[0, 1] == 5.0).all()     # only the block
    assert merged_lse[0, 0, 2] == np.float32(1e30) and (merged[0, 2] == 1.0).all()


def test_zigzag_chunks():
    assert [chunks_of(r, 4, "zigzag") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert chunks_of(2, 4, "contiguous") == (2,)
    with pytest.raises(ValueError, match="unknown layout"):
        chunks_of(0, 4, "spiral")


def test_planner_cost_model_follows_the_seed_fact():
    """Neither scheme wins everywhere: with a fast all-to-all and slow hops
    Ulysses wins, with the opposite the ring does; few heads rule Ulysses out."""
    from commlib.hybrid.planner import Fabric, price

    fast_a2a = Fabric(1e-5, 50e9, 1e-3, 0.1e9, 1e15, 1e12)
    slow_a2a = Fabric(1e-3, 0.05e9, 1e-5, 50e9, 1e15, 1e12)
    shape = dict(seq_len=65536, num_heads=32, num_kv_heads=8, head_dim=128, itemsize=2,
                 causal=False, layout="contiguous")
    for fabric, winner in ((fast_a2a, 8), (slow_a2a, 1)):
        costs = {u: price(8, u, fabric=fabric, **shape).seconds for u in (1, 2, 4, 8)}
        assert min(costs, key=costs.get) == winner, costs
    ulysses = price(8, 8, fabric=fast_a2a, **shape)
    assert ulysses.ring_bytes == 0 and ulysses.ulysses_bytes == \
        (2 * 32 + 2 * 8) * 65536 / 8 * 128 * 2 * 7 / 8
    ring = price(8, 1, fabric=fast_a2a, **shape)
    assert ring.ulysses_bytes == 0 and ring.ring_bytes == 2 * 65536 / 8 * 8 * 128 * 2 * 7
