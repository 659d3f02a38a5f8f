"""Attention over a KV cache sharded by position (``commlib.inference``)
against torch SDPA on the unsharded sequence (float64, the explicit
mask): decode of tokens every rank holds, and a chunk's prefill by pass-Q
and pass-KV, at every world size, in every framework; GQA, windows, batches,
prefill shards of every layout and lengths the world size does not
divide; bad input raises on every rank."""

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.inference import (
    ShardedKVCache,
    chunk_attention,
    decode_attention,
    prefill_bytes,
    striped,
)
from commlib.sequence.documents import local_index, needed_length, packing_for

import arrayimpl
import requires
from attention_reference import masked_torch_reference, position_mask, relative_error
from conftest import all_ranks, raises_everywhere

# the striped cache at 1 (no peers), even and odd sizes
WORLD_SIZES = (1, 2, 3)

requires.module("torch")
requires.module("jax")

HEADS, DIM = 8, 8
TOLERANCE = {"float32": 3e-5, "bfloat16": 1.5e-2}
CASES = [pytest.param(p.values[0], dtype, id=f"{p.id}-{dtype}", marks=p.marks)
         for p in arrayimpl.params() for dtype in
         (["float32", "bfloat16"] if p.id in ("torch", "torch-cuda") else ["float32"])]


def shard_positions(comm, prefill, total, layout):
    """This rank's cached positions: its shard of a prefill of ``prefill``
    tokens in ``layout`` (padding dropped), then every later position p
    with p % P == rank."""
    packing = packing_for([0, prefill], layout, comm.size,
                          needed_length((0, prefill), layout, comm.size))
    index = local_index(packing, comm.rank)
    later = np.arange(prefill, total)
    return np.concatenate([index[index >= 0], later[striped(later, comm.size, comm.rank)]])


def tensors(seed, batch, length, kv_heads):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, length, h, DIM)) for h in (HEADS, kv_heads, kv_heads)]


def reference(q, k, v, q_positions, causal, window):
    """SDPA of the queries at ``q_positions`` over all keys 0..L-1."""
    mask = position_mask(q_positions, np.arange(k.shape[1]), causal, window)
    zero = np.zeros_like(q[:, q_positions])
    return masked_torch_reference(q[:, q_positions], k, v, zero, mask)[0]


DECODE = {  # prefill tokens, new tokens t, batch, kv heads, causal, window, layout
    "one-token": (37, 1, 1, 2, True, None, "zigzag"),
    "gqa-batch": (30, 1, 2, 2, True, None, "contiguous"),
    "three-new": (29, 3, 1, 8, True, None, "zigzag"),
    "window": (41, 2, 1, 4, True, (6, 0), "zigzag"),
    "mqa-long-decode": (9, 1, 1, 1, True, None, "contiguous"),
    "bidirectional": (23, 2, 1, 2, False, None, "zigzag_docs"),
}


@pytest.mark.quick_sample(8)
@pytest.mark.parametrize("case", DECODE)
@pytest.mark.parametrize("impl, dtype", CASES)
def test_decode_is_sdpa_over_the_whole_cache(comm, impl, dtype, case):
    """New tokens held by every rank, attending a cache sharded by position
    (a prefill's shard, then striped tokens; 40 decoded tokens before them
    in "mqa-long-decode"): every rank's out is SDPA's on the unsharded
    sequence, the same bits on every rank, in the caller's framework."""
    prefill, new, batch, kv_heads, causal, window, layout = DECODE[case]
    decoded = 40 if case == "mqa-long-decode" else 0
    total = prefill + decoded + new
    q, k, v = tensors(7, batch, total, kv_heads)
    mine = shard_positions(comm, prefill, total, layout)
    asked = np.arange(prefill + decoded, total)
    out = decode_attention(impl.asarray(q[:, asked], dtype), impl.asarray(k[:, mine], dtype),
                           impl.asarray(v[:, mine], dtype), comm, q_positions=asked,
                           k_positions=mine, causal=causal, window=window)
    got = impl.to_numpy(out)
    error = relative_error(got, reference(q, k, v, asked, causal, window))
    everyone = MPI.COMM_WORLD.allgather(got.tobytes())
    assert all_ranks(impl.is_native(out) and impl.dtype_name(out) == dtype
                     and error <= TOLERANCE[dtype] and len(set(everyone)) == 1), error


CHUNK = {  # cached tokens, chunk tokens, kv heads, window
    "short-chunk": (60, 5, 2, None),
    "long-chunk": (8, 50, 8, None),
    "window": (33, 21, 4, (7, 0)),
    "chunk-shorter-than-ranks": (17, 2, 2, None),
}


@pytest.mark.quick_sample(8)
@pytest.mark.parametrize("method", ["pass_q", "pass_kv", "auto"])
@pytest.mark.parametrize("case", CHUNK)
@pytest.mark.parametrize("impl, dtype", CASES)
def test_a_chunk_against_the_cache_is_sdpa(comm, impl, dtype, case, method):
    """A second turn: the chunk striped by position (its keys stored with
    the cache first), each rank's queries over every key: SDPA's, by
    pass-Q, pass-KV or the cost model's pick."""
    cached, chunk, kv_heads, window = CHUNK[case]
    total = cached + chunk
    q, k, v = tensors(11, 1, total, kv_heads)
    mine = shard_positions(comm, cached, total, "zigzag")
    new = np.arange(cached, total)
    asked = new[striped(new, comm.size, comm.rank)]
    out = chunk_attention(impl.asarray(q[:, asked], dtype), impl.asarray(k[:, mine], dtype),
                          impl.asarray(v[:, mine], dtype), comm, q_positions=asked,
                          k_positions=mine, causal=True, window=window, method=method)
    error = relative_error(impl.to_numpy(out), reference(q, k, v, asked, True, window))
    assert all_ranks(impl.is_native(out) and error <= TOLERANCE[dtype]), error


def test_the_cost_model_passes_queries_for_a_short_chunk():
    """pass-Q moves the chunk's queries and partials, pass-KV the cache:
    a short chunk against a long cache passes Q, a long one KV; GQA makes
    K and V cheaper to pass."""
    def pick(chunk, cached, kv_heads):
        costs = prefill_bytes([chunk // 4] * 4, [(cached + chunk) // 4] * 4, 1, 32, kv_heads,
                              128, 2)
        return min(costs, key=costs.get)
    assert pick(1024, 100_000, 32) == "pass_q" and pick(100_000, 1024, 32) == "pass_kv"
    assert pick(8192, 32_000, 32) == "pass_q" and pick(8192, 32_000, 4) == "pass_kv"


def test_different_new_tokens_raise_on_every_rank(comm):
    """Decode's queries must be the same tokens everywhere: other positions
    on one rank raise on all (no partials of different tokens merged)."""
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")  # counted: rank_outcomes.ALLOWED_SKIPS
    q, k, v = tensors(3, 1, 20, 2)
    mine = shard_positions(comm, 18, 20, "zigzag")
    asked = np.array([18, 19]) if comm.rank else np.array([17, 19])
    raises_everywhere(commlib.CollectiveMismatchError, lambda: decode_attention(
        q[:, asked], k[:, mine], v[:, mine], comm, q_positions=asked, k_positions=mine,
        causal=True),
        match="q_positions")


@pytest.mark.parametrize("bad", ["unordered", "count", "floats", "heads"])
def test_bad_positions_and_shapes_raise_on_every_rank(comm, bad):
    q, k, v = tensors(5, 1, 30, 2)
    mine = shard_positions(comm, 28, 30, "contiguous")
    asked = np.array([28, 29])
    q, k, v = q[:, asked], k[:, mine], v[:, mine]
    if comm.rank == comm.size - 1:
        if bad == "unordered":
            mine = mine[::-1].copy()
        elif bad == "count":
            asked = np.array([28])
        elif bad == "floats":
            mine = mine.astype(np.float64)
        else:
            k, v = k[:, :, :, :3], v[:, :, :, :3]
    raises_everywhere(commlib.CollectiveMismatchError, lambda: decode_attention(
        q, k, v, comm, q_positions=asked, k_positions=mine, causal=True))


@pytest.mark.parametrize("impl", arrayimpl.params(("numpy", "torch", "jax")))
def test_the_cache_keeps_this_ranks_positions_and_grows(comm, impl):
    """A prefill's shard, then one decoded token a step: each rank keeps
    the tokens at p % P == rank, the shard grows past its first capacity,
    and every layer reads back exactly what it stored: layer 0 K and a
    narrower V, layer 1 K alone (a latent cache: no V held)."""
    cache = ShardedKVCache(2, comm.size, comm.rank)
    rng = np.random.default_rng(comm.rank)

    def store(tokens):
        for layer, v in enumerate((impl.asarray(tokens[..., :3] * 2), None)):
            keys, values = cache.store(layer, impl.asarray(tokens * (layer + 1)), v)
        return keys, values

    first = rng.standard_normal((1, 5, 2, 4)).astype(np.float32)
    cache.admit(np.arange(5) * comm.size + comm.rank, np.arange(5), 5 * comm.size)
    store(first)
    stored = [first]
    for position in range(5 * comm.size, 5 * comm.size + 23):
        step = rng.standard_normal((1, 1, 2, 4)).astype(np.float32)
        keep = striped([position], comm.size, comm.rank)
        cache.admit(np.array([position])[keep], keep, position + 1)
        keys, values = store(step)
        if keep.size:
            stored.append(step)
    expected = np.concatenate(stored, axis=1)
    kept = cache.positions
    assert all_ranks(np.all(kept % comm.size == comm.rank) and np.all(np.diff(kept) > 0)
                     and cache.tokens == expected.shape[1]
                     and np.array_equal(impl.to_numpy(cache.keys(0)), expected)
                     and np.array_equal(impl.to_numpy(cache.values(0)), 2 * expected[..., :3])
                     and np.array_equal(impl.to_numpy(keys), 2 * expected)
                     and values is None and cache.values(1) is None
                     and cache.nbytes() == cache.tokens * 2 * (4 + 3 + 4) * 4
                     and impl.is_native(keys) and cache.length == 5 * comm.size + 23)


def test_a_step_out_of_order_is_refused():
    cache = ShardedKVCache(1, 2, 0)
    cache.admit([0, 2, 4], [0, 1, 2], 6)
    with pytest.raises(ValueError, match="after the cached ones"):
        cache.admit([2], [0], 7)
    with pytest.raises(ValueError, match="stores once per admitted step"):
        cache.admit([6], [0], 7)
        cache.store(0, np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1)))


def test_a_layer_stored_with_and_without_v_is_refused():
    """A layer keeps K alone from its first store on, even one that admits
    no token of this rank (so every rank refuses alike)."""
    cache = ShardedKVCache(1, 2, 1)
    cache.admit([], [], 1)  # position 0 is rank 0's
    cache.store(0, np.zeros((1, 1, 1, 2)), None)
    assert cache.values(0) is None
    cache.admit([1], [0], 2)
    with pytest.raises(ValueError, match="keeps K alone: store it alike"):
        cache.store(0, np.zeros((1, 1, 1, 2)), np.zeros((1, 1, 1, 2)))
