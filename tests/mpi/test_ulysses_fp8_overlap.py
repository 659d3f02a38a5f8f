"""Ulysses' FP8 wire and Ulysses overlapped with the projection.

FP8 (``wire="float8"``): the relayouts within e4m3's round-trip bound of
the exact relayout, element by element; attention within a measured bound
of the same call without a wire (every framework with float8, uneven heads,
GQA, the hybrid's Ulysses stage); half the bytes of a bfloat16 exchange plus
the scales, counted; refused on every rank where it cannot run (an unknown
wire, a framework without float8, gradients wanted).

Overlap (``ulysses_attention_overlapped``): equal to ``ulysses_attention``
of the same q, k, v for every group count, with GQA, uneven heads, a mask
and the FP8 wire; its torch gradients (projection weights included) equal
to the non-overlapped binding's; bad groups and bad projections refused on
every rank."""

import numpy as np
import pytest

import commlib
from commlib import hybrid, ring, ulysses
from commlib.sequence import masks

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

WORLD_SIZES = (2, 3, 4)

torch = requires.module("torch")
requires.module("jax")

SEQ, DIM = 24, 16
FP8_IMPLS = arrayimpl.params(exclude=("cupy",))
HALF_ULP = 2.0 ** -4          # e4m3's relative round-trip error
SUBNORMAL = 2.0 ** -10 / 448  # times the amax: the subnormal floor
# the attention output's error against the same call without a wire, relative
# to max |out|: q, k, v ~ N(0, 1), 1-5 heads of dim 16, causal, 24 tokens;
# measured at most 0.067, 0.090 and 0.080 at 2, 3 and 4 ranks (float32 and bfloat16
# alike): e4m3's 2**-4 per element, on q, k, v and again on the output
OUT_BOUND = 0.18


def _global(heads, kv_heads, seed, batch=2):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, SEQ, h, DIM)) for h in (heads, kv_heads, kv_heads)]


def _shards(full, comm, impl, dtype, layout="zigzag"):
    return [impl.asarray(ring.shard_sequence(x, comm, layout=layout), dtype) for x in full]


def _relative(got, want):
    return float(np.abs(got - want).max() / np.abs(want).max())


# -- FP8 -----------------------------------------------------------------------

@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", FP8_IMPLS)
def test_float8_relayouts_are_within_e4m3s_rounding(comm, impl, dtype):
    heads = comm.size + 1  # uneven wherever P > 1
    (x, _, _) = _global(heads, heads, seed=1)
    x[:, :, 0] *= 100.0  # an outlier head: its scale must not coarsen the others
    shard = impl.asarray(ring.shard_sequence(x, comm, layout="contiguous"), dtype)
    exact = impl.to_numpy(ulysses.seq_to_head(shard, comm)).astype(np.float64)
    moved = ulysses.seq_to_head(shard, comm, wire="float8")
    got = impl.to_numpy(moved).astype(np.float64)
    amax = np.abs(exact).max(axis=(1, 3), keepdims=True)  # a message's amax is at most this
    rounding = HALF_ULP + 2.0 ** -8  # bfloat16 rounds the dequantized value again
    ok = impl.is_native(moved) and impl.dtype_name(moved) == dtype
    ok = ok and bool((np.abs(got - exact) <= rounding * np.abs(exact) + SUBNORMAL * amax).all())
    back = ulysses.head_to_seq(moved, comm, heads, wire="float8")  # and back: rounded twice
    again = impl.to_numpy(back).astype(np.float64)
    start = impl.to_numpy(shard).astype(np.float64)
    ok = ok and impl.is_native(back) and bool(
        (np.abs(again - start) <= 2.2 * rounding * np.abs(start)
         + 2 * SUBNORMAL * np.abs(start).max(axis=(1, 3), keepdims=True)).all())
    assert all_ranks(ok)


@pytest.mark.quick_sample(6)
@pytest.mark.parametrize("heads, kv_heads", [(5, 5), (6, 2), (4, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", FP8_IMPLS)
def test_float8_attention_is_near_the_exact_exchange(comm, impl, dtype, heads, kv_heads):
    q, k, v = _shards(_global(heads, kv_heads, seed=heads), comm, impl, dtype)
    options = dict(layout="zigzag", causal=True)
    exact = ulysses.ulysses_attention(q, k, v, comm, **options)
    fp8 = ulysses.ulysses_attention(q, k, v, comm, wire="float8", **options)
    error = _relative(impl.to_numpy(fp8).astype(np.float64),
                      impl.to_numpy(exact).astype(np.float64))
    assert all_ranks(impl.is_native(fp8) and impl.dtype_name(fp8) == dtype
                     and 0 < error <= OUT_BOUND), error


def test_float8_in_the_hybrid_and_the_torch_binding(comm):
    from commlib.bindings import torch as binding
    degree = comm.size // 2 if comm.size % 2 == 0 else comm.size
    q, k, v = (torch.tensor(x) for x in
               _shards(_global(4, 2, seed=3), comm, arrayimpl.IMPLS["numpy"], "float32"))
    options = dict(layout="zigzag", causal=True)
    exact = hybrid.hybrid_attention(q, k, v, comm, degree, **options)
    errors = [_relative(hybrid.hybrid_attention(q, k, v, comm, degree, wire="float8",
                                                **options).numpy(), exact.numpy())]
    with torch.no_grad():
        errors.append(_relative(binding.hybrid_attention(q, k, v, comm, degree, wire="float8",
                                                         **options).numpy(), exact.numpy()))
        core = ulysses.ulysses_attention(q, k, v, comm, wire="float8", **options)
        bound = binding.ulysses_attention(q, k, v, comm, wire="float8", **options)
    assert all_ranks(all(0 < e <= OUT_BOUND for e in errors) and torch.equal(core, bound))


def test_float8_with_sinks_applies_them_once(comm):
    """Sinks and the FP8 wire together (forward only): near
    the exact exchange with the same sinks, the binding equal to the core,
    and far from the call without sinks (so they were applied)."""
    from commlib.bindings import torch as binding
    degree = comm.size // 2 if comm.size % 2 == 0 else comm.size
    q, k, v = (torch.tensor(x) for x in
               _shards(_global(5, 5, seed=4), comm, arrayimpl.IMPLS["numpy"], "float32"))
    sinks = torch.linspace(1.0, 4.0, 5)   # large: they take much of each softmax
    options = dict(layout="zigzag", causal=True, sinks=sinks)
    errors, effects = [], []
    with torch.no_grad():
        for run in (lambda **o: ulysses.ulysses_attention(q, k, v, comm, **o),
                    lambda **o: hybrid.hybrid_attention(q, k, v, comm, degree, **o)):
            exact, fp8 = run(**options), run(wire="float8", **options)
            errors.append(_relative(fp8.numpy(), exact.numpy()))
            effects.append(_relative(run(layout="zigzag", causal=True).numpy(), exact.numpy()))
        core = ulysses.ulysses_attention(q, k, v, comm, wire="float8", **options)
        equal = torch.equal(core, binding.ulysses_attention(q, k, v, comm, wire="float8",
                                                            **options))
    assert all_ranks(all(0 < e <= OUT_BOUND for e in errors) and equal
                     and min(effects) > 2 * max(errors)), (errors, effects)


class _CountingComm:
    """The communicator, counting the bytes Ulysses hands it to send."""

    def __init__(self, comm):
        self._comm, self.sent = comm, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, arrays):
        self.sent += sum(x.numel() * x.element_size() for x in arrays)

    def alltoall(self, x, *args):
        self._count([x])
        return self._comm.alltoall(x, *args)

    def alltoall_many(self, arrays):
        self._count(arrays)
        return self._comm.alltoall_many(arrays)

    def alltoall_many_async(self, arrays):
        self._count(arrays)
        return self._comm.alltoall_many_async(arrays)


@pytest.mark.parametrize("overlapped", [False, True])
def test_float8_moves_half_the_bytes_of_bfloat16(comm, overlapped):
    heads, batch = 2 * comm.size, 2
    q, k, v = (torch.tensor(ring.shard_sequence(x, comm, layout="contiguous"),
                            dtype=torch.bfloat16) for x in _global(heads, heads, 4, batch))
    sent = {}
    for wire in (None, "float8"):
        counting = _CountingComm(comm)
        options = dict(layout="contiguous", causal=False, wire=wire)
        if overlapped:
            ulysses.ulysses_attention_overlapped(
                lambda h, kv: (q[:, :, h], k[:, :, kv], v[:, :, kv]), counting,
                num_heads=heads, groups=2, **options)
        else:
            ulysses.ulysses_attention(q, k, v, counting, **options)
        sent[wire] = counting.sent
    # q, k, v in and out back: each message one float32 scale per (batch, head)
    scales = 4 * 4 * batch * heads  # 4 tensors' heads, over the P messages each
    assert all_ranks(sent[None] == 4 * q.numel() * 2 and sent["float8"] * 2 == sent[None]
                     + 2 * scales), sent


def test_float8_refused_where_it_cannot_run(comm, monkeypatch):
    from commlib.bindings import torch as binding
    q, k, v = (torch.tensor(x) for x in
               _shards(_global(comm.size, comm.size, seed=5), comm, arrayimpl.IMPLS["numpy"],
                       "float32"))
    options = dict(layout="zigzag", causal=True)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: ulysses.ulysses_attention(q, k, v, comm, wire="fp8", **options),
                      match="unknown wire='fp8'")
    # one rank wants gradients: every rank refuses
    wants = q.clone().requires_grad_(comm.rank == 0)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: binding.ulysses_attention(wants, k, v, comm, wire="float8",
                                                        **options),
                      match="is for inference (forward only)")
    monkeypatch.delattr(torch, "float8_e4m3fn")  # a torch without float8
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: ulysses.ulysses_attention(q, k, v, comm, wire="float8", **options),
                      match="has no float8 type")


# -- overlap -------------------------------------------------------------------

def _group_counts(heads, kv_heads, size):
    """Every count that gives each rank a head of each group and keeps a kv
    head's query heads in one group, or one group's in one kv head."""
    readers = heads // kv_heads
    return [g for g in range(1, heads + 1) if heads % g == 0 and heads // g >= size
            and ((heads // g) % readers == 0 or readers % (heads // g) == 0)]


@pytest.mark.quick_sample(6)
@pytest.mark.parametrize("wire", [None, "float8"])
@pytest.mark.parametrize("heads, kv_heads", [(12, 12), (12, 4), (12, 2), (10, 5)])
@pytest.mark.parametrize("impl", [arrayimpl.IMPLS["numpy"], arrayimpl.IMPLS["torch"]])
def test_overlapped_equals_ulysses_attention(comm, impl, heads, kv_heads, wire):
    q, k, v = _shards(_global(heads, kv_heads, seed=6), comm, impl, "float32")
    options = dict(layout="zigzag", causal=True, wire=wire)
    want, want_lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, **options)
    asked, ok = [], True
    for groups in _group_counts(heads, kv_heads, comm.size):
        def project(h, kv):
            asked.append((h, kv))
            return q[:, :, h], k[:, :, kv], v[:, :, kv]
        out, lse = ulysses.ulysses_attention_overlapped(project, comm, num_heads=heads,
                                                        num_kv_heads=kv_heads, groups=groups,
                                                        return_lse=True, **options)
        ok = ok and impl.is_native(out) and _relative(impl.to_numpy(out),
                                                      impl.to_numpy(want)) <= 1e-6
        ok = ok and np.allclose(impl.to_numpy(lse), impl.to_numpy(want_lse), rtol=1e-6)
        # the groups tile the heads, in order
        ok = ok and [h.start for h, _ in asked[-groups:]] == list(range(0, heads, heads // groups))
    assert all_ranks(ok)


def test_overlapped_passes_a_mask_through(comm):
    heads = 2 * comm.size
    rng = np.random.default_rng(7)
    full = [rng.standard_normal((1, 8 * comm.size, heads, 8)) for _ in range(3)]
    length = 8 * comm.size
    mask = masks.from_cu_seqlens([0, 5, length], causal=False)  # two documents
    q, k, v = (ring.shard_sequence(x, comm, layout="contiguous") for x in full)
    options = dict(layout="contiguous", causal=False, mask=mask)
    want = ulysses.ulysses_attention(q, k, v, comm, **options)
    got = ulysses.ulysses_attention_overlapped(
        lambda h, kv: (q[:, :, h], k[:, :, kv], v[:, :, kv]), comm, num_heads=heads, groups=2,
        **options)
    assert all_ranks(np.array_equal(got, want))


# (heads, kv heads, groups) at P ranks: MHA; groups of whole kv heads; groups inside one
GRADIENT_CASES = {"mha": lambda p: (3 * p, 3 * p, 3), "gqa": lambda p: (2 * p, 2, 2),
                  "inside a kv head": lambda p: (4 * p, 1, 2)}


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_overlapped_gradients_match_the_binding(comm, case):
    from commlib.bindings import torch as binding
    heads, kv_heads, groups = GRADIENT_CASES[case](comm.size)
    torch.manual_seed(8)  # the same weights and input on every rank
    hidden = 24
    x = ring.shard_sequence(torch.randn(1, 4 * comm.size * 2, hidden), comm, layout="zigzag")
    weights = [torch.randn(n * DIM, hidden, requires_grad=True) / hidden ** 0.5
               for n in (heads, kv_heads, kv_heads)]
    weights = [w.detach().requires_grad_() for w in weights]

    def projected():
        return [(x @ w.T).unflatten(-1, (-1, DIM)) for w in weights]
    options = dict(layout="zigzag", causal=True)
    q, k, v = projected()
    want = binding.ulysses_attention(q, k, v, comm, **options)
    (want * want).sum().backward()
    expected = [w.grad for w in weights]
    for w in weights:
        w.grad = None
    q, k, v = projected()  # sliced per group: the gradient flows back through the slices
    got = binding.ulysses_attention_overlapped(
        lambda h, kv: (q[:, :, h], k[:, :, kv], v[:, :, kv]), comm, num_heads=heads,
        num_kv_heads=kv_heads, groups=groups, **options)
    (got * got).sum().backward()
    ok = torch.equal(got.detach(), want.detach()) and got.requires_grad
    ok = ok and all(_relative(w.grad.numpy(), e.numpy()) <= 1e-5
                    for w, e in zip(weights, expected))
    assert all_ranks(ok)


def test_overlapped_refuses_bad_groups_and_projections_on_every_rank(comm):
    heads = 2 * comm.size
    q, k, v = (ring.shard_sequence(x, comm, layout="contiguous")
               for x in _global(heads, 2, seed=9, batch=1))

    def run(groups, num_kv_heads=2, project=None, heads=heads):
        return lambda: ulysses.ulysses_attention_overlapped(
            project or (lambda h, kv: (q[:, :, h], k[:, :, kv], v[:, :, kv])), comm,
            num_heads=heads, num_kv_heads=num_kv_heads, groups=groups, layout="contiguous",
            causal=True)
    refused = commlib.CollectiveMismatchError
    raises_everywhere(refused, run(heads + 1), match=f"does not divide num_heads={heads}")
    raises_everywhere(refused, run(heads), match="a rank would own no head of a group")
    raises_everywhere(refused, run(0), match="groups must be a positive integer")
    raises_everywhere(refused, run(2, num_kv_heads=heads - 1),
                      match="must be a multiple of num_kv_heads")
    odd = 2 * comm.size - 1  # 2 groups of an odd count of heads, kv heads read by 2 each
    raises_everywhere(refused, run(2, num_kv_heads=odd, heads=2 * odd),
                      match="would split the 2 query heads of a kv head")
    raises_everywhere(refused, run(2, project=lambda h, kv: (q, k, v)),
                      match=f"must return q of shape [batch, seq/P, {heads // 2}, head_dim]")

    def fails_on_rank_0(h, kv):
        if comm.rank == 0:
            raise RuntimeError("out of memory in the projection")
        return q[:, :, h], k[:, :, kv], v[:, :, kv]
    raises_everywhere(refused, run(2, project=fails_on_rank_0),
                      match="out of memory in the projection")
