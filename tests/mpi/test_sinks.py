"""Attention sinks (gpt-oss: one learned logit per query head in every
softmax) in every attention: ring, all-gather, sparse, Ulysses (heads split
unevenly too) and the hybrid, forward and backward, against gpt-oss's
eager softmax with the sink column on the unsharded sequence (float64,
autograd); the lse returned includes the sink; each rank's dsinks is its
own queries' share; decode and chunk attention over the sharded cache (with
Gemma2's cap and without);
bad sinks refused on every rank. The conformance matrix
(test_conformance.py) crosses sinks with every other option pairwise."""

import numpy as np
import pytest
from binding_calls import entry_call, through_binding

import commlib
from commlib import hybrid, ring, ulysses
from commlib.inference import chunk_attention, decode_attention

import arrayimpl
import requires
from attention_reference import (
    document_mask,
    eager_reference,
    position_mask,
    relative_error,
    sink_reference,
)
from conftest import all_ranks, raises_everywhere

# odd sizes change the layouts' cuts and the head splits; 4 makes the
# hybrid a 2 x 2 grid whose Ulysses groups split 5 heads 3 + 2
WORLD_SIZES = (2, 3, 4)

torch = requires.module("torch")
jax = requires.module("jax")

SEQ, DIM = 24, 8
METHODS = ("ring", "allgather", "sparse", "ulysses", "hybrid")
# (heads, kv heads, layout, attention keywords): GQA, MQA over heads that
# no world size here divides evenly, packed documents with padding (an
# uneven length), a sliding window, no mask
CASES = {"causal-gqa": (6, 2, "zigzag", {"causal": True}),
         "docs-mqa-uneven-heads": (5, 1, "zigzag_docs",
                                   {"causal": True, "cu_seqlens": [0, 7, 19]}),
         "window-mha": (4, 4, "contiguous", {"causal": True, "window": (5, 0)}),
         "bidirectional": (6, 3, "zigzag", {"causal": False})}
# (out, gradients) relative to max(1, |reference|), as test_attention_frameworks.py's
TOLERANCE = {"float64": (1e-12, 1e-12), "float32": (3e-5, 1.2e-4),
             "bfloat16": (1.5e-2, 3e-2)}


def _global(heads, kv_heads, seed, length=SEQ):
    """q, k, v, dout of the whole sequence and sinks near the scores'
    log-sum-exp (so that they take a real share), float64."""
    rng = np.random.default_rng(seed)
    full = [rng.standard_normal((2, length, h, DIM)) for h in (heads, kv_heads, kv_heads, heads)]
    return full, rng.normal(1.5, 1.0, heads)


def _degree(comm):
    return comm.size // 2 if comm.size % 2 == 0 else comm.size


def _attention(method, q, k, v, dout, sinks, comm, **options):
    """(out, lse, (dq, dk, dv, dsinks)) of the core ``method``."""
    if method in ("ring", "allgather", "sparse"):
        out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, method=method,
                                       sinks=sinks, **options)
        return out, lse, ring.ring_attention_backward(dout, q, k, v, out, lse, comm,
                                                      method=method, sinks=sinks, **options)
    if method == "ulysses":
        out, lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, sinks=sinks,
                                             **options)
        return out, lse, ulysses.ulysses_attention_backward(dout, q, k, v, out, lse, comm,
                                                            sinks=sinks, **options)
    degree = _degree(comm)
    out, lse = hybrid.hybrid_attention(q, k, v, comm, degree, return_lse=True, sinks=sinks,
                                       **options)
    return out, lse, hybrid.hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree,
                                                      sinks=sinks, **options)


def _sink_lse(q, k, mask, sinks):
    """logsumexp over [scores, sink] [b, h, s], float64 (what lse must be)."""
    group = q.shape[2] // k.shape[2]
    scores = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, group, axis=2)) / np.sqrt(DIM)
    scores = np.where(mask, scores, -np.inf)
    column = np.broadcast_to(sinks[None, :, None, None], scores.shape[:3] + (1,))
    both = np.concatenate([scores, column], axis=-1)
    top = both.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(both - top).sum(axis=-1, keepdims=True)))[..., 0]


@pytest.mark.quick_sample(8)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_the_eager_softmax_with_the_sink_column(comm, method, case):
    """out, lse (the sink included), dq, dk, dv and dsinks (each rank its
    own queries' share; the shares add up to the whole) of every method,
    float64, against gpt-oss's eager softmax on the unsharded sequence."""
    heads, kv_heads, layout, options = CASES[case]
    cu_seqlens = options.get("cu_seqlens")
    length = SEQ if cu_seqlens is None else cu_seqlens[-1]
    full, sinks = _global(heads, kv_heads, seed=len(case) + len(method), length=length)
    dense = document_mask(length, cu_seqlens, options["causal"], options.get("window"))
    shards = dict(layout=layout, cu_seqlens=cu_seqlens)
    mine = [ring.shard_sequence(x, comm, **shards) for x in full]
    out, lse, (dq, dk, dv, dsinks) = _attention(method, *mine, sinks, comm, layout=layout,
                                                **options)

    def whole(x):
        return ring.unshard_sequence(x, comm, **shards, length=None if cu_seqlens else length)
    want = sink_reference(*full, dense, sinks)
    errors = [relative_error(whole(x), w) for x, w in zip((out, dq, dk, dv), want)]
    errors.append(relative_error(comm.allreduce(dsinks), want[4]))
    lse_seq = whole(np.ascontiguousarray(np.transpose(lse, (0, 2, 1))))
    errors.append(relative_error(np.transpose(lse_seq, (0, 2, 1)),
                                 _sink_lse(full[0], full[1], dense, sinks)))
    # this rank's dsinks: the reference's with dout on this rank's queries only
    owner = whole(np.full(mine[0].shape[:2] + (1, 1), comm.rank, np.float64))
    partial = sink_reference(*full[:3], full[3] * (owner == comm.rank), dense, sinks)[4]
    errors.append(relative_error(dsinks, partial))
    assert all_ranks(max(errors) <= 1e-12), errors


# JAX's eager kernel compiles per shape (about 15 s a case here): its cases
# run in the full tier; the quick tier meets JAX's sinks through the binding
DTYPE_CASES = [pytest.param(p.values[0], dtype, id=f"{p.id}-{dtype}",
                            marks=[*p.marks, *([pytest.mark.full] if p.id == "jax" else [])])
               for p in arrayimpl.params() for dtype in ("float32", "bfloat16")
               if not (p.id == "cupy" and dtype == "bfloat16")]


@pytest.mark.quick_sample(3)
@pytest.mark.parametrize("impl, dtype", DTYPE_CASES)
def test_frameworks_and_dtypes_keep_the_sink_math_in_the_accumulator(comm, impl, dtype):
    """The core functions on each framework's arrays, sinks in q's dtype:
    out, dq, dk, dv and dsinks come back in that framework and dtype, lse in
    float32, all within the dtype's tolerance of the float64 reference.
    (JAX's eager kernel compiles per shape: the ring alone here; its
    Ulysses and hybrid are the binding's, in the conformance matrix.)"""
    full, sinks = _global(6, 2, seed=5)
    rounded = [impl.to_numpy(impl.asarray(x, dtype)).astype(np.float64) for x in full]
    sinks = impl.to_numpy(impl.asarray(sinks, dtype)).astype(np.float64)
    dense = document_mask(SEQ, None, True)
    want = sink_reference(*rounded, dense, sinks)
    layout = "zigzag"
    bounds = TOLERANCE[dtype]
    ok = True
    errors = []
    for method in ("ring",) if impl.framework == "jax" else ("ring", "ulysses", "hybrid"):
        mine = [impl.asarray(ring.shard_sequence(x, comm, layout=layout), dtype)
                for x in rounded]
        out, lse, grads = _attention(method, *mine, impl.asarray(sinks, dtype), comm,
                                     layout=layout, causal=True)
        ok = ok and all(impl.is_native(x) and impl.dtype_name(x) == dtype
                        for x in (out, *grads))
        ok = ok and impl.dtype_name(lse) == "float32"
        got = [ring.unshard_sequence(impl.to_numpy(x).astype(np.float64), comm, layout=layout)
               for x in (out, *grads[:3])]
        got.append(comm.allreduce(impl.to_numpy(grads[3]).astype(np.float64)))
        errors += [relative_error(g, w) for g, w in zip(got, want)]
        ok = ok and errors[-5] <= bounds[0] and max(errors[-4:]) <= bounds[1]
    assert all_ranks(ok), errors


@pytest.mark.parametrize("api", ["torch", "jax"])
def test_the_bindings_differentiate_the_sinks(comm, api):
    """The torch binding's autograd and the JAX binding's custom_vjp (under
    jit) give the sinks their gradient: this rank's share, summing to the
    reference's."""
    heads, kv_heads, layout, options = CASES["docs-mqa-uneven-heads"]
    cu = options["cu_seqlens"]
    full, sinks = _global(heads, kv_heads, seed=11, length=cu[-1])
    want = sink_reference(*full, document_mask(cu[-1], cu, True), sinks)
    mine = [ring.shard_sequence(x, comm, layout=layout, cu_seqlens=cu) for x in full]
    errors = []
    for name in ("ring", "ulysses", "hybrid"):
        args = (_degree(comm),) if name == "hybrid" else ()
        keywords = dict(layout=layout, causal=True, cu_seqlens=cu)
        got = through_binding(api, name, mine, sinks, comm, args, keywords)
        whole = [ring.unshard_sequence(x, comm, layout=layout, cu_seqlens=cu) for x in got[:4]]
        errors += [relative_error(g, w) for g, w in zip(whole + [comm.allreduce(got[4])], want)]
    assert all_ranks(max(errors) <= 1e-12), errors


def test_a_sink_of_minus_infinity_is_no_sink(comm):
    """exp(-inf) = 0: out and lse as without sinks, dsinks 0, no NaN (a
    padded row, that saw neither key nor sink, too)."""
    cu = [0, 7, 19]
    full, _ = _global(6, 2, seed=3, length=cu[-1])
    options = dict(layout="zigzag_docs", causal=True, cu_seqlens=cu)
    mine = [ring.shard_sequence(x, comm, layout="zigzag_docs", cu_seqlens=cu) for x in full]
    plain_out, plain_lse = ring.ring_attention(*mine[:3], comm, return_lse=True, **options)
    out, lse, grads = _attention("ring", *mine, np.full(6, -np.inf), comm, **options)
    ok = np.array_equal(out, plain_out) and np.array_equal(lse, plain_lse)
    assert all_ranks(ok and not np.isnan(grads[0]).any() and np.array_equal(grads[3], 0 * grads[3]))


# -- inference: decode and a chunk over the sharded cache --------------------

CACHED, NEW = 13, 5


# decode with positions on the device: an array of q's framework other than
# NumPy (the torch binding always takes that path)
# JAX's eager kernel compiles per shape (seconds a case): its cases run in the full tier
INFERENCE_CASES = [pytest.param(impl, entry, marks=[pytest.mark.full] if impl == "jax" else [])
                   for impl in ("numpy", "torch", "torch-binding", "jax")
                   for entry in ("decode", "decode-on-device", "chunk-pass_q", "chunk-pass_kv")
                   if entry != "decode-on-device" or impl in ("torch", "jax")]


@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("impl, entry", INFERENCE_CASES)
def test_inference_over_the_sharded_cache_takes_the_sinks(comm, impl, entry, softcap):
    """decode_attention and chunk_attention (core in each framework, and the
    torch binding's ops) with sinks, a window and GQA, and Gemma2's cap or
    none, against the eager softmax with the sink column (of the capped
    scores) over the whole cache."""
    full, sinks = _global(6, 2, seed=9, length=CACHED + NEW)
    if softcap is not None:  # scores large enough for the cap to bend them
        full = [x * 2 for x in full]
    q, k, v, _ = full
    keys = np.arange(comm.rank, CACHED + NEW, comm.size)
    new = np.arange(CACHED, CACHED + NEW)
    asked = new if entry.startswith("decode") else np.array_split(new, comm.size)[comm.rank]
    array = arrayimpl.IMPLS["torch" if impl == "torch-binding" else impl]
    with jax.enable_x64(True):
        arrays = [array.asarray(x) for x in (q[:, asked], k[:, keys], v[:, keys], sinks)]
        positions = (array.asarray(asked), array.asarray(keys)) \
            if entry == "decode-on-device" else (asked, keys)
        options = dict(q_positions=positions[0], k_positions=positions[1], causal=True,
                       window=(6, 0), sinks=arrays[3], softcap=softcap)
        if entry.startswith("chunk"):
            options["method"] = entry.removeprefix("chunk-")
        if impl == "torch-binding":
            from commlib.bindings import torch as ct
            attention = ct.decode_attention if entry.startswith("decode") else \
                ct.chunk_attention
        else:
            attention = decode_attention if entry.startswith("decode") else chunk_attention
        out = array.to_numpy(attention(*arrays[:3], comm, **options))
    mask = position_mask(asked, np.arange(CACHED + NEW), causal=True, window=(6, 0))
    want = eager_reference(q[:, asked], k, v, np.zeros_like(q[:, asked]), mask, sinks=sinks,
                           softcap=softcap)[0]
    assert all_ranks(relative_error(out, want) <= 1e-10)


def test_a_decode_cache_step_takes_the_sinks(comm):
    """The torch DecodeCache (fixed buffers, positions on the device): a
    step's attend with sinks is the eager softmax with the sink column."""
    from commlib.bindings import torch as ct
    full, sinks = _global(4, 2, seed=13, length=CACHED + NEW)
    q, k, v, _ = (torch.tensor(x) for x in full)
    cache = ct.DecodeCache(comm, 1, capacity=CACHED + NEW, batch=2, kv_heads=2, head_dim=DIM,
                           dtype=torch.float64)
    positions = torch.arange(CACHED + NEW)
    cache.advance(positions)
    cache.store(0, k, v)  # it keeps this rank's stripe
    asked = positions[CACHED:]
    out = cache.attend(0, q[:, CACHED:], asked, causal=True, sinks=torch.tensor(sinks))
    mask = position_mask(asked.numpy(), np.arange(CACHED + NEW), causal=True)
    want = sink_reference(full[0][:, CACHED:], full[1], full[2],
                          np.zeros_like(full[0][:, CACHED:]), mask, sinks)[0]
    assert all_ranks(relative_error(out.numpy(), want) <= 1e-12)


# -- bad sinks: one clear error on every rank, before anything moves ---------

BAD = {"shape": "sinks must have shape (4,)", "integer": "sinks must be floating",
       "framework": "sinks must be an array of q's framework",
       "one-rank-only": "different arguments", "dtype-differs": "different arguments"}
ENTRIES = ("ring", "ulysses", "hybrid", "torch-ring", "jax-ulysses", "decode", "chunk")


def _bad_sinks(kind, comm, framework):
    """This rank's sinks for the bad ``kind`` (the last rank alone is wrong
    where the others are right)."""
    make = arrayimpl.IMPLS[framework].asarray
    wrong = comm.rank == comm.size - 1
    if kind == "shape":
        return make(np.zeros(5 if wrong else 4))
    if kind == "integer":
        return make(np.zeros(4, np.int64 if wrong else np.float64))
    if kind == "framework":
        return (arrayimpl.IMPLS["numpy" if framework != "numpy" else "torch"].asarray
                if wrong else make)(np.zeros(4))
    if kind == "one-rank-only":
        return None if wrong else make(np.zeros(4))
    return make(np.zeros(4, np.float16 if wrong else np.float32))


@pytest.mark.quick_sample(12)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_sinks_are_refused_on_every_rank(comm, kind, entry):
    framework = {"torch-ring": "torch", "jax-ulysses": "jax"}.get(entry, "numpy")
    make = arrayimpl.IMPLS[framework].asarray
    rng = np.random.default_rng(0)
    q, k, v = (make(rng.standard_normal((1, 4, h, DIM))) for h in (4, 2, 2))
    sinks = _bad_sinks(kind, comm, framework)
    raises_everywhere(ValueError, entry_call(entry, q, k, v, comm, sinks=sinks), match=BAD[kind])


def test_a_bad_sinks_backward_is_refused_on_every_rank(comm):
    """The core backward checks its sinks as the forward does."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4, h, DIM)) for h in (4, 2, 2))
    options = dict(layout="contiguous", causal=True)
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, sinks=np.zeros(4), **options)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention_backward(
        out, q, k, v, out, lse, comm, sinks=np.zeros(3), **options),
        match="sinks must have shape (4,)")
