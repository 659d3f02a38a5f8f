"""Logit soft-capping (Gemma2, Grok: scores s -> cap * tanh(s / cap)
before the softmax) in every attention: ring, all-gather, sparse, Ulysses
and the hybrid, forward and backward, with sinks, windows and packed
documents, against the eager float64 reference written out step by step
(tests/attention_reference.py's ``eager_reference``); the torch and JAX
bindings; Ulysses overlapped with the projection (decode and chunk
attention over the sharded cache, capped: test_sinks.py); a bad cap (not
positive, not finite, not a number, different across ranks) and a kernel
that cannot cap refused on every rank. The conformance matrix
(test_conformance.py) crosses softcap with every other option pairwise."""

import numpy as np
import pytest
from binding_calls import entry_call, through_binding

import commlib
from commlib import hybrid, ring, ulysses
from commlib.kernels import TILED, Kernel

import arrayimpl
import requires
from attention_reference import document_mask, eager_reference, relative_error
from conftest import all_ranks, raises_everywhere

WORLD_SIZES = (2, 3)

torch = requires.module("torch")
jax = requires.module("jax")

SEQ, DIM, CAP = 24, 8, 2.0
METHODS = ("ring", "allgather", "sparse", "ulysses", "hybrid")
# (heads, kv heads, layout, attention keywords, with sinks)
CASES = {"causal-gqa-sinks": (6, 2, "zigzag", {"causal": True}, True),
         "docs-mqa": (6, 1, "zigzag_docs", {"causal": True, "cu_seqlens": [0, 7, 19]}, False),
         "window-sinks": (6, 3, "contiguous", {"causal": True, "window": (5, 0)}, True),
         "bidirectional": (6, 6, "zigzag", {"causal": False}, False)}


def _global(heads, kv_heads, seed, length=SEQ):
    """q, k, v, dout of the whole sequence, float64, large enough that the
    cap bends the scores; and sinks [heads]."""
    rng = np.random.default_rng(seed)
    full = [rng.standard_normal((2, length, h, DIM)) * 2
            for h in (heads, kv_heads, kv_heads, heads)]
    return full, rng.normal(1.5, 1.0, heads)


def _degree(comm):
    return comm.size // 2 if comm.size % 2 == 0 else comm.size


def _attention(method, q, k, v, dout, comm, **options):
    """(out, (dq, dk, dv[, dsinks])) of the core ``method``."""
    if method in ("ring", "allgather", "sparse"):
        out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, method=method, **options)
        return out, ring.ring_attention_backward(dout, q, k, v, out, lse, comm, method=method,
                                                 **options)
    if method == "ulysses":
        out, lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, **options)
        return out, ulysses.ulysses_attention_backward(dout, q, k, v, out, lse, comm, **options)
    degree = _degree(comm)
    out, lse = hybrid.hybrid_attention(q, k, v, comm, degree, return_lse=True, **options)
    return out, hybrid.hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree,
                                                 **options)


@pytest.mark.quick_sample(6)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", METHODS)
def test_every_method_is_the_eager_capped_softmax(comm, method, case):
    """out, dq, dk, dv (and dsinks, summed over the ranks) of every method,
    float64, within 1e-10 of the eager capped softmax on the unsharded
    sequence; and not within it of the uncapped one (the cap matters)."""
    heads, kv_heads, layout, options, with_sinks = CASES[case]
    cu_seqlens = options.get("cu_seqlens")
    length = SEQ if cu_seqlens is None else cu_seqlens[-1]
    full, sinks = _global(heads, kv_heads, seed=len(case) + len(method), length=length)
    sinks = sinks if with_sinks else None
    dense = document_mask(length, cu_seqlens, options["causal"], options.get("window"))
    shards = dict(layout=layout, cu_seqlens=cu_seqlens)
    mine = [ring.shard_sequence(x, comm, **shards) for x in full]
    out, grads = _attention(method, *mine, comm, layout=layout, sinks=sinks, softcap=CAP,
                            **options)

    def whole(x):
        return ring.unshard_sequence(x, comm, **shards, length=None if cu_seqlens else length)
    got = [whole(x) for x in (out, *grads[:3])] + [comm.allreduce(x) for x in grads[3:]]
    want = eager_reference(*full, dense, sinks=sinks, softcap=CAP)
    uncapped = eager_reference(*full, dense, sinks=sinks)
    errors = [relative_error(g, w) for g, w in zip(got, want)]
    assert len(got) == len(want) and all_ranks(max(errors) <= 1e-10), errors
    assert relative_error(got[0], uncapped[0]) > 1e-3


# JAX compiles each program here (about 15 s): the full tier; the quick tier
# meets JAX's cap in the conformance matrix's sample
@pytest.mark.parametrize("api", ["torch", pytest.param("jax", marks=pytest.mark.full)])
def test_the_bindings_cap_forward_and_backward(comm, api):
    """The torch binding's ops (autograd) and the JAX binding's custom_vjp
    (under jit) with a cap, sinks and packed documents: out, dq, dk, dv and
    dsinks of ring, Ulysses and the hybrid against the eager reference."""
    cu = [0, 7, 19]
    full, sinks = _global(6, 2, seed=11, length=cu[-1])
    want = eager_reference(*full, document_mask(cu[-1], cu, True), sinks=sinks, softcap=CAP)
    mine = [ring.shard_sequence(x, comm, layout="zigzag_docs", cu_seqlens=cu) for x in full]
    errors = []
    for name in ("ring", "ulysses", "hybrid"):
        args = (_degree(comm),) if name == "hybrid" else ()
        keywords = dict(layout="zigzag_docs", causal=True, cu_seqlens=cu, softcap=CAP)
        got = through_binding(api, name, mine, sinks, comm, args, keywords)
        whole = [ring.unshard_sequence(x, comm, layout="zigzag_docs", cu_seqlens=cu)
                 for x in got[:4]]
        errors += [relative_error(g, w) for g, w in zip(whole + [comm.allreduce(got[4])], want)]
    assert all_ranks(max(errors) <= 1e-10), errors


def test_torch_under_a_cap_runs_the_tiled_kernel_not_sdpa(comm):
    """PyTorch's fused SDPA cannot cap: under softcap= the torch ring runs
    the tiled kernel in torch (the profiler sees no SDPA op)."""
    from torch.profiler import profile
    full, _ = _global(4, 2, seed=2)
    q, k, v = (torch.tensor(ring.shard_sequence(x, comm, layout="zigzag")) for x in full[:3])
    with profile() as capped:
        ring.ring_attention(q, k, v, comm, layout="zigzag", causal=True, softcap=CAP)
    with profile() as plain:
        ring.ring_attention(q, k, v, comm, layout="zigzag", causal=True)
    names = [{e.name for e in p.events()} for p in (capped, plain)]
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    assert all_ranks(sdpa not in names[0] and "aten::tanh" in names[0] and sdpa in names[1])


def test_ulysses_overlapped_with_the_projection_caps(comm):
    """ulysses_attention_overlapped (head groups pipelined with the caller's
    projection) under a cap: out against the eager capped softmax."""
    full, _ = _global(12, 12, seed=4)
    mine = [ring.shard_sequence(x, comm, layout="zigzag") for x in full[:3]]

    def project(heads, kv_heads):
        return mine[0][:, :, heads], mine[1][:, :, kv_heads], mine[2][:, :, kv_heads]
    out = ulysses.ulysses_attention_overlapped(project, comm, num_heads=12, groups=2,
                                               layout="zigzag", causal=True, softcap=CAP)
    want = eager_reference(*full, document_mask(SEQ, None, True), softcap=CAP)[0]
    got = ring.unshard_sequence(out, comm, layout="zigzag")
    assert all_ranks(relative_error(got, want) <= 1e-10)


# -- a bad cap: one clear error on every rank, before anything moves ---------

BAD = {"zero": (0.0, "softcap must be a positive finite number"),
       "negative": (-30.0, "softcap must be a positive finite number"),
       "nan": (float("nan"), "softcap must be a positive finite number"),
       "infinite": (float("inf"), "softcap must be a positive finite number"),
       "text": ("50", "softcap must be a positive finite number"),
       "bool": (True, "softcap must be a positive finite number"),
       "differs": (None, "different arguments")}
ENTRIES = ("ring", "allgather", "ulysses", "hybrid", "torch-ring", "jax-ulysses", "decode",
           "chunk")


@pytest.mark.quick_sample(10)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_cap_is_refused_on_every_rank(comm, kind, entry):
    """A cap that is not a positive finite number, on the last rank alone
    (the others' is good), or a good cap that differs across ranks."""
    framework = {"torch-ring": "torch", "jax-ulysses": "jax"}.get(entry, "numpy")
    make = arrayimpl.IMPLS[framework].asarray
    rng = np.random.default_rng(0)
    q, k, v = (make(rng.standard_normal((1, 4, h, DIM))) for h in (4, 2, 2))
    bad, message = BAD[kind]
    wrong = comm.rank == comm.size - 1
    softcap = (30.0 + wrong) if kind == "differs" else (bad if wrong else 30.0)
    raises_everywhere(ValueError, entry_call(entry, q, k, v, comm, softcap=softcap),
                      match=message)


def test_a_kernel_that_cannot_cap_is_refused_on_every_rank(comm):
    """kernel= a Kernel without ``takes_softcap`` under a cap: refused on
    every rank (the last rank's alone cannot cap), forward and backward."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 4, h, DIM)) for h in (4, 2, 2))
    blind = Kernel(TILED.forward, TILED.backward, "blind")
    kernel = blind if comm.rank == comm.size - 1 else TILED
    options = dict(layout="contiguous", causal=True, softcap=CAP)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention(
        q, k, v, comm, kernel=kernel, **options), match="cannot cap the scores")
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, **options)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: ring.ring_attention_backward(
        out, q, k, v, out, lse, comm, kernel=kernel, **options), match="cannot cap the scores")
