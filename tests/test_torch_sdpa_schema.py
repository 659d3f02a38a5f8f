"""The CUDA half of commlib's torch kernel (PyTorch's private flash and
memory-efficient aten ops) against the installed PyTorch's op schemas, on
meta tensors: their meta kernels bind the arguments and build the outputs as
the CUDA dispatch does, so a PyTorch release that moves an argument, renames
a keyword or changes what an op returns fails here, on a machine without a
GPU, instead of on the first GPU run."""

import pytest

import requires

torch = requires.module("torch")

from commlib.kernels import torch_sdpa  # noqa: E402  (after the torch check)

# (kernel, native GQA) as _cuda_choice gives them; flash never serves float32
CHOICES = [("flash", True, torch.bfloat16), ("flash", True, torch.float16),
           ("efficient", False, torch.bfloat16), ("efficient", False, torch.float16),
           ("efficient", False, torch.float32)]
# (batch, query length, key length, heads, kv heads, head dim): GQA, a length
# not a multiple of the efficient kernel's 32-row lse padding, unequal lengths
SHAPES = [(2, 64, 64, 8, 8, 64), (2, 64, 64, 8, 2, 128), (1, 33, 33, 4, 1, 64),
          (1, 40, 72, 4, 4, 64)]
# commlib's causal means equal query and key lengths
SHAPES_CAUSAL = [(shape, causal) for shape in SHAPES for causal in (False, True)
                 if not causal or shape[1] == shape[2]]


def _meta(batch, seq, heads, dim, dtype):
    return torch.empty(batch, seq, heads, dim, dtype=dtype, device="meta")


@pytest.mark.parametrize("shape, causal", SHAPES_CAUSAL,
                         ids=["x".join(map(str, s)) + ("-causal" if c else "")
                              for s, c in SHAPES_CAUSAL])
@pytest.mark.parametrize("choice, native_gqa, dtype", CHOICES,
                         ids=[f"{c}-{str(d).removeprefix('torch.')}" for c, _, d in CHOICES])
def test_cuda_kernels_bind_and_return_what_commlib_expects(monkeypatch, choice, native_gqa,
                                                           dtype, causal, shape):
    batch, seq_q, seq_k, heads, kv_heads, dim = shape
    monkeypatch.setattr(torch_sdpa, "_cuda_choice", lambda q, k, causal: (choice, native_gqa))
    q, dout = _meta(batch, seq_q, heads, dim, dtype), _meta(batch, seq_q, heads, dim, dtype)
    k, v = _meta(batch, seq_k, kv_heads, dim, dtype), _meta(batch, seq_k, kv_heads, dim, dtype)

    out, lse = torch_sdpa.forward(q, k, v, causal, dim ** -0.5)
    assert (out.shape, out.dtype) == (q.shape, dtype)
    assert (lse.shape, lse.dtype) == ((batch, heads, seq_q), torch.float32)

    # the global out arrives in float32 from the merge of the ring's blocks
    grads = torch_sdpa.backward(dout, q, k, v, out.float(), lse, causal, dim ** -0.5)
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, dtype) for x in (q, k, v)]


def test_the_efficient_kernel_pads_lse_to_32_rows():
    """forward slices the efficient kernel's lse, backward pads it back: both
    assume its rows are padded to a multiple of 32."""
    q = _meta(1, 4, 33, 64, torch.float16)  # already [b, h, s, d]
    lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, True)[1]
    assert lse.shape == (1, 4, 64)


def test_the_dispatcher_query_accepts_commlib_s_arguments():
    """_cuda_choice builds SDPAParams with GQA and asks both kernels: the
    answer for meta tensors is PyTorch's to give, but the calls must bind."""
    q = _meta(1, 16, 4, 64, torch.bfloat16)
    k = _meta(1, 16, 2, 64, torch.bfloat16)
    assert torch_sdpa._cuda_choice(q, k, True) in {("flash", True), ("efficient", False),
                                                   (None, False)}
