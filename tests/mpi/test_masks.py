"""Any mask across ranks (``mask=``, ``commlib.sequence.masks``): Ring, Ulysses and
the hybrid, forward and backward, against torch SDPA with the dense boolean
mask on the unsharded sequence (float64), at every world size and in every
layout (``balanced`` included): prefix-LM, a shared prefix with 4 causal
branches, a multimodal mix, sliding windows inside packed documents,
random slice sets (hypothesis) and masks from FlexAttention mask_mods; the
same mask on every rank (a different one raises on all)."""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis_ranks import given_on_every_rank

import commlib
from commlib import hybrid, ring, ulysses
from commlib.sequence.common_masks import block_diagonal, multimodal, prefix_lm, shared_prefix
from commlib.sequence.masks import KINDS, Mask, Slice, from_cu_seqlens, from_mask_mod

import arrayimpl
import requires
from attention_reference import document_mask, masked_torch_reference, relative_error
from conftest import all_ranks, raises_everywhere, same_on_all_ranks

# the balanced solver's placements at even, odd and grid sizes
WORLD_SIZES = (2, 3, 4)

torch = requires.module("torch")
requires.module("jax")

LENGTH, HEADS, KV_HEADS, DIM = 61, 4, 2, 8  # 61: no world size divides it
TOLERANCE = {"float32": (3e-5, 1.2e-4), "bfloat16": (1.5e-2, 3e-2)}


def _doc_mod(length, documents):
    doc = torch.as_tensor(np.repeat(np.arange(documents), -(-length // documents))[:length])
    return lambda b, h, q, k: (doc[q] == doc[k]) & (q >= k)


MASKS = {
    "prefix-lm": lambda: prefix_lm(LENGTH, 20),
    "shared-prefix-4-branches": lambda: shared_prefix(LENGTH, 17, 4),
    "multimodal": lambda: multimodal(LENGTH, [(9, 21), (40, 47)]),
    "windows-in-documents": lambda: from_cu_seqlens([0, 13, 40, LENGTH], causal=True,
                                                            window=(6, 0)),
    "mask-mod-causal": lambda: from_mask_mod(lambda b, h, q, k: q >= k, LENGTH, block=16),
    "mask-mod-window": lambda: from_mask_mod(lambda b, h, q, k: (q >= k) & (q - k < 9),
                                             LENGTH, block=16),
    "mask-mod-document": lambda: from_mask_mod(_doc_mod(LENGTH, 3), LENGTH, block=16),
}
LAYOUTS = ["contiguous", "zigzag", "zigzag_docs", "balanced"]


def _global(seed, length=LENGTH):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, length, h, DIM)) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]


def _ring(q, k, v, dout, comm, **options):
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, **options)
    return out, ring.ring_attention_backward(dout, q, k, v, out, lse, comm, **options)


def _ulysses(q, k, v, dout, comm, **options):
    out, lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, **options)
    return out, ulysses.ulysses_attention_backward(dout, q, k, v, out, lse, comm, **options)


def _hybrid(q, k, v, dout, comm, **options):
    degree = 2 if comm.size % 2 == 0 else 1
    out, lse = hybrid.hybrid_attention(q, k, v, comm, degree, return_lse=True, **options)
    return out, hybrid.hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree,
                                                 **options)


ALGORITHMS = {"ring": lambda *a, **o: _ring(*a, method="ring", **o),
              "ring-allgather": lambda *a, **o: _ring(*a, method="allgather", **o),
              "ring-sparse": lambda *a, **o: _ring(*a, method="sparse", **o),
              "ring-auto": _ring, "ulysses": _ulysses,
              "hybrid-sparse": lambda *a, **o: _hybrid(*a, method="sparse", **o)}


def check(comm, impl, dtype, mask, layout, algorithm, seed=0):
    """The algorithm's out and (dq, dk, dv) on this rank's shards against
    SDPA on the whole sequence with ``mask.dense()``, within tolerance."""
    return compare(comm, impl, dtype, mask.dense(), layout, algorithm, dict(mask=mask), seed=seed,
                   causal=False)


def compare(comm, impl, dtype, dense, layout, algorithm, placed, seed=0, **options):
    """``check`` for shards placed by ``placed`` (``mask=`` or
    ``cu_seqlens=``) and attended with ``placed`` and ``options``
    (``causal``, ``window``), against SDPA with ``dense``."""
    q, k, v, dout = _global(seed, len(dense))
    want = masked_torch_reference(q, k, v, dout, dense)

    def shard(x):
        return ring.shard_sequence(impl.asarray(x, dtype), comm, layout=layout, **placed)
    out, grads = ALGORITHMS[algorithm](shard(q), shard(k), shard(v), shard(dout), comm,
                                       layout=layout, **placed, **options)

    def whole(x):
        return impl.to_numpy(ring.unshard_sequence(x, comm, layout=layout, length=len(dense),
                                                   **placed))
    errors = [relative_error(whole(got), ref) for got, ref in zip((out, *grads), want)]
    bound = TOLERANCE[dtype]
    return impl.is_native(out) and errors[0] <= bound[0] and max(errors[1:]) <= bound[1], errors


@pytest.mark.quick_sample(24)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MASKS)
def test_every_mask_every_layout_is_sdpa_with_the_dense_mask(comm, name, layout, algorithm):
    ok, errors = check(comm, arrayimpl.IMPLS["torch"], "float32", MASKS[name](), layout,
                       algorithm)
    assert all_ranks(ok), errors


# causal attention without a mask: documents and a window as cu_seqlens and window=
PACKED = {"causal": (None, None), "documents": ([0, 13, 40, LENGTH], None),
          "documents-window": ([0, 13, 40, LENGTH], (6, 0))}


@pytest.mark.parametrize("algorithm", ["ring-sparse", "hybrid-sparse"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("name", PACKED)
def test_sparse_without_a_mask_routes_documents_causality_and_window(comm, name, layout,
                                                                      algorithm):
    """method="sparse" with causal, cu_seqlens and window instead of mask=:
    the routes come from their mask. The hybrid's ring of groups had no
    documents to read (AttributeError: 'Grouped' object has no attribute
    'offsets')."""
    cu_seqlens, window = PACKED[name]
    length = 48 if cu_seqlens is None else LENGTH  # 48: every layout's chunks at 2-4 ranks
    dense = document_mask(length, cu_seqlens, causal=True, window=window)
    ok, errors = compare(comm, arrayimpl.IMPLS["torch"], "float32", dense, layout, algorithm,
                         dict(cu_seqlens=cu_seqlens), causal=True, window=window)
    assert all_ranks(ok), errors


@pytest.mark.parametrize("impl, dtype", [pytest.param(p.values[0], d, id=f"{p.id}-{d}",
                                                      marks=p.marks)
                                         for p in arrayimpl.params()
                                         for d in (["float32", "bfloat16"]
                                                   if p.id in ("torch", "torch-cuda")
                                                   else ["float32"])])
@pytest.mark.quick_sample(3)
def test_every_framework_attends_a_mask(comm, impl, dtype):
    """One mask, the ring, the balanced layout, in every framework."""
    ok, errors = check(comm, impl, dtype, shared_prefix(LENGTH, 17, 4), "balanced", "ring")
    assert all_ranks(ok), errors


@st.composite
def slice_sets(draw):
    """Non-overlapping slices of every kind on a grid of random cuts."""
    length = draw(st.integers(8, 70))
    q_cuts = sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=3)))
                    | {0, length})
    k_cuts = sorted(set(draw(st.lists(st.integers(1, length - 1), max_size=3)))
                    | {0, length})
    parts = []
    for q in zip(q_cuts, q_cuts[1:]):
        for k in zip(k_cuts, k_cuts[1:]):
            kind = draw(st.sampled_from((None,) + KINDS))
            if kind is not None:
                parts.append(Slice(q, k, kind))
    return Mask(parts or [Slice((0, length), (0, length), "causal")], length=length)


@given_on_every_rank(mask=slice_sets(), layout=st.sampled_from(LAYOUTS),
       algorithm=st.sampled_from(["ring", "ring-sparse", "ulysses"]))
def test_random_slice_sets(comm, mask, layout, algorithm):
    same_on_all_ranks((mask.digest(), layout, algorithm))
    ok, errors = check(comm, arrayimpl.IMPLS["torch"], "float32", mask, layout, algorithm)
    assert all_ranks(ok), errors


def test_a_different_mask_on_one_rank_raises_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    mask = prefix_lm(LENGTH, 20 if comm.rank else 21)
    q, k, v, _ = _global(0)
    shards = [ring.shard_sequence(x, comm, layout="zigzag", mask=prefix_lm(LENGTH, 20))
              for x in (q, k, v)]
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention(
        *shards, comm, layout="zigzag", causal=False, mask=mask), match="different arguments")


@pytest.mark.parametrize("bad", ["with-causal", "not-a-mask", "other-length"])
def test_bad_masks_raise_on_every_rank(comm, bad):
    q, k, v, _ = _global(0)
    mask = prefix_lm(LENGTH, 20)
    shards = [ring.shard_sequence(x, comm, layout="contiguous", mask=mask) for x in (q, k, v)]
    options = {"with-causal": dict(mask=mask, causal=True),
               "not-a-mask": dict(mask=mask.dense(), causal=False),
               "other-length": dict(mask=prefix_lm(3 * LENGTH, 20), causal=False)}[bad]
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention(
        *shards, comm, layout="contiguous", **options))


def test_balanced_shards_need_the_mask(comm):
    """The balanced layout without a mask is refused, by shard_sequence and
    by the attention, with the fix."""
    q, k, v, _ = _global(0)
    with pytest.raises(ValueError, match="pass mask="):
        ring.shard_sequence(q, comm, layout="balanced")
    mask = block_diagonal(LENGTH, 3, causal=False)
    shards = [ring.shard_sequence(x, comm, layout="balanced", mask=mask) for x in (q, k, v)]
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention(
        *shards, comm, layout="balanced", causal=True), match="pass mask=")


def _torch_binding(q, k, v, dout, comm, **options):
    from commlib.bindings import torch as binding

    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = binding.ring_attention(q, k, v, comm, **options)
    out.backward(dout)
    return out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("algorithm", ["ring", "ring-sparse", "ulysses", "hybrid-sparse",
                                       "torch-binding"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_mask_shorter_than_the_shards_raises_on_every_rank(comm, layout, algorithm):
    """Shards of 24 tokens with a 10-token mask: the queries past 10 were
    padding to it and came back 0, silently."""
    placed = dict(mask=block_diagonal(24, 2, causal=False)) if layout == "balanced" else {}
    shards = [ring.shard_sequence(torch.as_tensor(x), comm, layout=layout, **placed)
              for x in _global(0, 24)]
    attend = ALGORITHMS.get(algorithm, _torch_binding)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: attend(
        *shards, comm, layout=layout, causal=False, mask=from_cu_seqlens([0, 10], causal=True)),
        match="the mask covers 10 tokens but the shards hold 24")
