"""Ring Attention against full attention on the unsharded sequence: NumPy
float64 and PyTorch scaled_dot_product_attention (forward, and backward
through autograd), at whatever world size this runs."""

import ml_dtypes
import numpy as np
import pytest

import commlib
from commlib import ring
from commlib.kernels import Kernel

from attention_reference import reference_attention, torch_reference
from conftest import all_ranks, raises_everywhere

torch = pytest.importorskip("torch")

SEQ, HEADS, DIM = 24, 4, 8  # 24 splits into 2P chunks for P = 1..4
TOLERANCE = {np.float32: 2e-5, np.float16: 4e-3, ml_dtypes.bfloat16: 3e-2}


def global_inputs(kv_heads, dtype, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, SEQ, HEADS, DIM)) * scale
    k = rng.standard_normal((2, SEQ, kv_heads, DIM)) * scale
    v = rng.standard_normal((2, SEQ, kv_heads, DIM))
    dout = rng.standard_normal((2, SEQ, HEADS, DIM))
    return [x.astype(dtype) for x in (q, k, v, dout)]


def close(a, b, tol):
    a = np.asarray(a, np.float64)
    return a.shape == b.shape and not np.isnan(a).any() and \
        np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("kv_heads", [HEADS, HEADS // 2, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
def test_forward_and_backward_match_full_attention(comm, causal, layout, kv_heads, dtype):
    q, k, v, dout = global_inputs(kv_heads, dtype)
    shard = [ring.shard_sequence(x, comm, layout) for x in (q, k, v, dout)]
    out, lse = ring.ring_attention(*shard[:3], comm, causal=causal, layout=layout,
                                   return_lse=True)
    grads = ring.ring_attention_backward(shard[3], *shard[:3], out, lse, comm,
                                         causal=causal, layout=layout)
    got = [ring.unshard_sequence(x, comm, layout) for x in (out, *grads)]
    got_lse = ring.unshard_sequence(lse, comm, layout, axis=2)
    ref_out, ref_lse = reference_attention(q, k, v, causal)
    torch_out, *torch_grads = torch_reference(q, k, v, dout, causal)
    tol = TOLERANCE[dtype]
    assert all_ranks(
        got[0].dtype == np.dtype(dtype) and lse.dtype == np.float32
        and close(got[0], ref_out, tol) and close(got[0], torch_out, tol)
        and close(got_lse, ref_lse, tol)
        and all(close(g, t, 4 * tol) for g, t in zip(got[1:], torch_grads)))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_torch_tensors_in_torch_tensors_out(comm, layout):
    q, k, v, dout = (torch.tensor(x) for x in global_inputs(2, np.float32, seed=1))
    shard = [ring.shard_sequence(x.to(torch.bfloat16), comm, layout) for x in (q, k, v, dout)]
    out, lse = ring.ring_attention(*shard[:3], comm, causal=True, layout=layout,
                                   return_lse=True)
    dq, dk, dv = ring.ring_attention_backward(shard[3], *shard[:3], out, lse, comm,
                                              causal=True, layout=layout)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert lse.dtype == torch.float32 and dk.dtype == torch.bfloat16
    full = ring.unshard_sequence(out, comm, layout).float().numpy()
    ref, _ = reference_attention(*(x.to(torch.bfloat16).float().numpy() for x in (q, k, v)),
                                 causal=True)
    assert all_ranks(close(full, ref, 3e-2))


@pytest.mark.parametrize("magnitude", [1e3, 1e6])
def test_extreme_scores_stay_finite(comm, magnitude):
    q, k, v, dout = global_inputs(2, np.float64, seed=2, scale=np.sqrt(magnitude))
    for layout in ("contiguous", "zigzag"):
        shard = [ring.shard_sequence(x, comm, layout) for x in (q, k, v, dout)]
        out, lse = ring.ring_attention(*shard[:3], comm, causal=True, layout=layout,
                                       return_lse=True)
        grads = ring.ring_attention_backward(shard[3], *shard[:3], out, lse, comm,
                                             causal=True, layout=layout)
        full = ring.unshard_sequence(out, comm, layout)
        ref, _ = reference_attention(q, k, v, True)
        finite = all(np.isfinite(np.asarray(g, np.float64)).all() for g in (out, lse, *grads))
        assert all_ranks(finite and close(full, ref, 1e-4))


def test_custom_block_kernel_is_used(comm):
    calls = []

    def counting_forward(q, k, v, causal, softmax_scale):
        calls.append(causal)
        return ring.attention_forward(q, k, v, causal, softmax_scale)

    q, k, v, _ = global_inputs(1, np.float32, seed=3)
    shard = [ring.shard_sequence(x, comm, "zigzag") for x in (q, k, v)]
    counting = Kernel(counting_forward, ring.attention_backward)
    out = ring.ring_attention(*shard, comm, causal=True, layout="zigzag", kernel=counting)
    ref, _ = reference_attention(q, k, v, True)
    full = ring.unshard_sequence(out, comm, "zigzag")
    assert all_ranks(len(calls) == comm.size and calls[0] is True and close(full, ref, 2e-5))


def test_softmax_scale(comm):
    q, k, v, _ = global_inputs(2, np.float32, seed=4)
    shard = [ring.shard_sequence(x, comm, "contiguous") for x in (q, k, v)]
    out = ring.ring_attention(*shard, comm, softmax_scale=0.05, layout="contiguous")
    ref, _ = reference_attention(q, k, v, False, scale=0.05)
    assert all_ranks(close(ring.unshard_sequence(out, comm, "contiguous"), ref, 2e-5))


def test_ring_exchange_visits_every_block_in_order(comm):
    seen = [(source, int(block[0])) for source, block in
            ring.RingExchange(comm).rotate(np.array([comm.rank * 10]))]
    expected = [((comm.rank - i) % comm.size, ((comm.rank - i) % comm.size) * 10)
                for i in range(comm.size)]
    assert all_ranks(seen == expected)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_round_trip(comm, layout):
    x = np.arange(2 * SEQ * 3).reshape(2, SEQ, 3)
    mine = ring.shard_sequence(x, comm, layout)
    assert all_ranks(mine.shape == (2, SEQ // comm.size, 3)
                     and np.array_equal(ring.unshard_sequence(mine, comm, layout), x))


# -- bad input: the same clear error on every rank --------------------------

def _shards(comm, kv_heads=2, seq=None, dim=DIM, dtype=np.float32):
    local = seq if seq is not None else 2 * 3
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, local, HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((1, local, kv_heads, dim)).astype(dtype)
    return q, k, k.copy()


@pytest.mark.parametrize("case, message", [
    ("kv_heads", "multiple of kv heads"),
    ("head_dim", "must agree on batch, local sequence length and head_dim"),
    ("dtype", "must have one dtype"),
    ("layout", "unknown layout 'spiral'"),
    ("odd_zigzag", "must be even"),
])
def test_bad_input_on_one_rank_raises_everywhere(comm, case, message):
    bad_rank = comm.size - 1
    kwargs = {"layout": "zigzag"}
    if comm.rank == bad_rank:
        q, k, v = {
            "kv_heads": lambda: _shards(comm, kv_heads=3),
            "head_dim": lambda: _shards(comm, dim=DIM + 1),
            "dtype": lambda: _shards(comm, dtype=np.float64),
            "layout": lambda: _shards(comm),
            "odd_zigzag": lambda: _shards(comm, seq=5),
        }[case]()
        if case == "layout":
            kwargs["layout"] = "spiral"
    else:
        q, k, v = _shards(comm)
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: ring.ring_attention(q, k, v, comm, **kwargs),
                              match=message)
    assert f"rank {bad_rank}" in str(error)


def test_local_lengths_that_differ_raise_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    q, k, v = _shards(comm, seq=6 if comm.rank else 8)
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: ring.ring_attention(q, k, v, comm, layout="zigzag"),
                              match="different arguments")
    assert "(1, 8, 4, 8)" in str(error) and "(1, 6, 4, 8)" in str(error)


def test_backward_checks_its_extra_inputs(comm):
    q, k, v = _shards(comm)
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: ring.ring_attention_backward(out[:, :2], q, k, v, out, lse, comm),
                      match="dout must have shape")
