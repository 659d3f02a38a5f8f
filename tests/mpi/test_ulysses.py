"""Ulysses relayout against slicing of the global tensor; Ulysses and hybrid
attention, forward and backward, against full attention (PyTorch SDPA and
autograd) on the unsharded sequence; bad input on every rank."""

import numpy as np
import pytest

import commlib
from commlib import hybrid, ring, ulysses
from commlib.ulysses.relayout import kv_heads_for

import requires
from attention_reference import reference_attention, torch_reference
from conftest import all_ranks, raises_everywhere

# heads over even and odd degrees; 4: the hybrid's 2 x 2 grid
WORLD_SIZES = (2, 3, 4)

torch = requires.module("torch")

SEQ, HEADS, DIM = 24, 12, 8  # 12 heads split over 1, 2, 3 and 4 ranks


def global_tensors(kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(2, SEQ, HEADS, DIM), (2, SEQ, kv_heads, DIM), (2, SEQ, kv_heads, DIM),
              (2, SEQ, HEADS, DIM)]
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def contiguous(x, comm):
    return ring.shard_sequence(x, comm, layout="contiguous")


def gathered(x, comm, layout="contiguous", axis=1):
    return ring.unshard_sequence(x, comm, layout=layout, axis=axis)


@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1])
def test_relayout_matches_slicing(comm, kv_heads):
    q, k, _, _ = global_tensors(kv_heads)
    per = HEADS // comm.size
    qh = ulysses.seq_to_head(contiguous(q, comm), comm)
    kh = ulysses.seq_to_head(contiguous(k, comm), comm, HEADS)
    fused_q, fused_k = ulysses.seq_to_head_many([contiguous(q, comm), contiguous(k, comm)], comm)
    mine = kv_heads_for(comm.rank, kv_heads, comm.size, HEADS)
    back = ulysses.head_to_seq(qh, comm)
    assert all_ranks(np.array_equal(qh, q[:, :, comm.rank * per:(comm.rank + 1) * per])
                     and np.array_equal(kh, k[:, :, mine])
                     and np.array_equal(fused_q, qh) and np.array_equal(fused_k, kh)
                     and np.array_equal(back, contiguous(q, comm)))


def test_relayout_keeps_the_framework(comm):
    x = torch.arange(2 * SEQ * HEADS * 3, dtype=torch.bfloat16).reshape(2, SEQ, HEADS, 3)
    y = ulysses.seq_to_head(contiguous(x, comm), comm)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    assert all_ranks(tuple(y.shape) == (2, SEQ, HEADS // comm.size, 3))


def _check_against_torch(comm, run, layout, kv_heads, causal):
    """``run`` on shards in ``layout`` against SDPA on the whole sequence:
    True on this rank."""
    q, k, v, dout = global_tensors(kv_heads, seed=kv_heads)
    out, lse, grads = run(*(ring.shard_sequence(x, comm, layout=layout) for x in (q, k, v, dout)))
    got = [gathered(x, comm, layout) for x in (out, *grads)]
    want = torch_reference(q, k, v, dout, causal)
    _, ref_lse = reference_attention(q, k, v, causal)
    ok = all(np.abs(np.asarray(g, np.float64) - w).max() < 5e-5 for g, w in zip(got, want))
    return ok and np.abs(gathered(lse, comm, layout, axis=2) - ref_lse).max() < 5e-5


# every layout: Ulysses permutes the gathered shards into sequence order,
# the hybrid's ring reads each group's spans
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_ulysses_attention(comm, layout, kv_heads, causal):
    def run(q, k, v, dout):
        options = dict(layout=layout, causal=causal)
        out, lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, **options)
        grads = ulysses.ulysses_attention_backward(dout, q, k, v, out, lse, comm, **options)
        return out, lse, grads
    assert all_ranks(_check_against_torch(comm, run, layout, kv_heads, causal))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_hybrid_attention_at_every_degree(comm, layout, kv_heads, causal):
    ok = True
    for degree in [d for d in range(1, comm.size + 1) if comm.size % d == 0]:
        def run(q, k, v, dout, degree=degree):
            options = dict(layout=layout, causal=causal)
            out, lse = hybrid.hybrid_attention(q, k, v, comm, degree, return_lse=True, **options)
            grads = hybrid.hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree,
                                                     **options)
            return out, lse, grads
        ok = _check_against_torch(comm, run, layout, kv_heads, causal) and ok
    assert all_ranks(ok)


def test_planner_picks_an_allowed_split(comm):
    plan = hybrid.plan(comm, seq_len=12288, num_heads=HEADS, num_kv_heads=2, head_dim=64,
                       causal=False, layout="contiguous")
    assert plan.ulysses_size * plan.ring_size == comm.size
    assert sorted({c.ulysses_size for c in plan.candidates}) == \
        [d for d in range(1, comm.size + 1) if comm.size % d == 0]  # 12 heads: every degree
    if comm.size > 1:  # a ring of P at Ulysses 1: both ways round it are priced
        assert {c.method for c in plan.candidates if c.ulysses_size == 1} == \
            {"ring", "allgather"}
    assert plan.predicted_seconds == min(c.seconds for c in plan.candidates)
    assert plan.method == min(plan.candidates, key=lambda c: c.seconds).method
    text = plan.explain()
    assert f"Picked Ulysses {plan.ulysses_size} x Ring {plan.ring_size}" in text
    assert "Fabric: all-to-all" in text
    same = hybrid.plan(comm, seq_len=12288, num_heads=HEADS, num_kv_heads=2, head_dim=64,
                       causal=False, layout="contiguous")
    assert same.fabric is plan.fabric  # probed once per communicator


# -- bad input ----------------------------------------------------------------

def _shards(comm, heads=HEADS, kv_heads=2, seq=6):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, seq, heads, DIM)).astype(np.float32)
    k = rng.standard_normal((1, seq, kv_heads, DIM)).astype(np.float32)
    return q, k, k.copy()


def test_local_lengths_that_differ(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    q, k, v = _shards(comm, kv_heads=1, seq=6 if comm.rank else 7)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: ulysses.ulysses_attention(q, k, v, comm, layout="contiguous",
                                                        causal=False),
                      match="different arguments")


def test_ulysses_size_must_divide_the_world(comm):
    q, k, v = _shards(comm)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: hybrid.hybrid_attention(q, k, v, comm, comm.size + 1,
                                                       layout="contiguous", causal=False),
                      match=f"must divide the world size {comm.size}")
