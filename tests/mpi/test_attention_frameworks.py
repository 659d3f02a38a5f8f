"""Ring, Ulysses and the hybrid in every framework, with one test body:
outputs and gradients against torch SDPA + autograd on the unsharded
sequence (float64), float32 at float32 tolerances, bfloat16 and float16 at
theirs; the results stay in the caller's framework, device and dtype; the
torch path runs PyTorch's fused kernels, not NumPy; a bfloat16 ring moves
half the bytes of a float32 one."""

import numpy as np
import pytest

from commlib import hybrid, ring, ulysses

import arrayimpl
import requires
from attention_reference import relative_error, torch_reference
from conftest import all_ranks

# odd sizes change the layouts' cuts; 4 makes the hybrid a 2 x 2 grid
WORLD_SIZES = (2, 3, 4)

torch = requires.module("torch")
requires.module("jax")

SEQ, HEADS, DIM = 24, 12, 8  # 24 splits into 2P chunks, 12 heads over P ranks, P = 1..4
# (out, gradients) bounds on the error relative to max(1, |reference|);
# float16 and bfloat16 at 2-3x the largest measured at 2 and 3 ranks (torch's
# ring, zigzag, at 3): out 6.6e-4 / 6.0e-3, gradients 1.5e-3 / 1.1e-2
TOLERANCE = {"float32": (3e-5, 1.2e-4), "float16": (1.5e-3, 4e-3), "bfloat16": (1.5e-2, 3e-2)}
DTYPES = {"numpy": ["float32", "bfloat16", "float16"], "torch": ["float32", "bfloat16", "float16"],
          "jax": ["float32", "bfloat16"], "cupy": ["float32", "float16"],
          "torch-cuda": ["float32", "bfloat16", "float16"], "jax-cuda": ["float32", "bfloat16"]}
CASES = [pytest.param(p.values[0], dtype, id=f"{p.id}-{dtype}", marks=p.marks)
         for p in arrayimpl.params() for dtype in DTYPES[p.id]]


def _global(kv_heads, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, SEQ, h, DIM)) for h in (HEADS, kv_heads, kv_heads, HEADS)]


def _ring(q, k, v, dout, comm, **options):
    out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, **options)
    return out, lse, ring.ring_attention_backward(dout, q, k, v, out, lse, comm, **options)


def _ulysses(q, k, v, dout, comm, **options):
    out, lse = ulysses.ulysses_attention(q, k, v, comm, return_lse=True, **options)
    return out, lse, ulysses.ulysses_attention_backward(dout, q, k, v, out, lse, comm, **options)


def _hybrid(q, k, v, dout, comm, **options):
    degree = comm.size // 2 if comm.size % 2 == 0 else comm.size  # a ring of 2 where possible
    out, lse = hybrid.hybrid_attention(q, k, v, comm, degree, return_lse=True, **options)
    return out, lse, hybrid.hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree,
                                                      **options)


# Ulysses and the hybrid in the layout that balances causal work (every
# layout, in float32: test_ulysses.py; with documents: test_packed.py)
ALGORITHMS = {"ring-zigzag": (_ring, "zigzag"), "ring-contiguous": (_ring, "contiguous"),
              "ulysses-zigzag": (_ulysses, "zigzag"), "hybrid-zigzag": (_hybrid, "zigzag")}


@pytest.mark.quick_sample(7)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("impl, dtype", CASES)
def test_outputs_and_gradients_match_sdpa(comm, impl, dtype, algorithm):
    run, layout = ALGORITHMS[algorithm]
    kv_heads = 1 if algorithm != "ring-contiguous" else HEADS  # GQA/MQA, and plain
    full = _global(kv_heads, seed=len(algorithm))
    rounded = [impl.to_numpy(impl.asarray(x, dtype)).astype(np.float64) for x in full]
    mine = [impl.asarray(ring.shard_sequence(x, comm, layout=layout), dtype) for x in full]
    out, lse, grads = run(*mine, comm, layout=layout, causal=True)
    want = torch_reference(*rounded, causal=True)
    out_bound, grad_bound = TOLERANCE[dtype]
    ok = all(impl.is_native(x) and impl.dtype_name(x) == dtype for x in (out, *grads))
    ok = ok and impl.is_native(lse) and impl.dtype_name(lse) == "float32"
    for got, ref, bound in zip((out, *grads), want, (out_bound, *[grad_bound] * 3)):
        whole = ring.unshard_sequence(impl.to_numpy(got).astype(np.float64), comm,
                                      layout=layout)
        ok = ok and relative_error(whole, ref) <= bound
    assert all_ranks(ok)


def test_torch_runs_the_fused_sdpa_kernels_not_numpy(comm, monkeypatch):
    """The torch path must call PyTorch's fused CPU flash kernels, forward
    and backward, and never the array-API (NumPy-style) kernel."""
    from commlib.kernels import tiled

    def refuse(*args, **kwargs):
        raise AssertionError("the tiled kernel ran for torch tensors")
    monkeypatch.setattr(tiled, "attention_forward", refuse)
    monkeypatch.setattr(tiled, "attention_backward", refuse)
    full = _global(2, seed=7)
    q, k, v, dout = (torch.tensor(ring.shard_sequence(x, comm, layout="zigzag"),
                                  dtype=torch.bfloat16) for x in full)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _ring(q, k, v, dout, comm, layout="zigzag", causal=True)
    ran = {event.key for event in prof.key_averages()}
    assert all_ranks("aten::_scaled_dot_product_flash_attention_for_cpu" in ran
                     and "aten::_scaled_dot_product_flash_attention_for_cpu_backward" in ran)


class _CountingComm:
    """The communicator, counting the bytes the ring hands it to send."""

    def __init__(self, comm):
        self._comm, self.sent = comm, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def ring_shift_async(self, x, shift=1, lane=0):
        self.sent += x.numel() * x.element_size()
        return self._comm.ring_shift_async(x, shift, lane)


def test_bfloat16_moves_half_the_bytes_of_float32(comm):
    full = _global(4, seed=8)
    sent = {}
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, dout = (torch.tensor(ring.shard_sequence(x, comm, layout="zigzag"), dtype=dtype)
                         for x in full)
        forward, backward = _CountingComm(comm), _CountingComm(comm)
        options = dict(layout="zigzag", causal=True)
        out, lse = ring.ring_attention(q, k, v, forward, return_lse=True, **options)
        ring.ring_attention_backward(dout, q, k, v, out, lse, backward, **options)
        sent[dtype] = forward.sent, backward.sent
    kv_bytes = 2 * k.numel() * 4 * (comm.size - 1)  # float32 K/V, one hop a step
    (f32_forward, f32_backward), (bf16_forward, bf16_backward) = sent.values()
    # forward: K/V only; backward: K/V in the input dtype, dK/dV in float32
    assert all_ranks(bf16_forward * 2 == f32_forward == kv_bytes
                     and bf16_backward == f32_backward - kv_bytes // 2)
