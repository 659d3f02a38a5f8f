"""PyTorch's fused attention kernels as commlib block kernels.

Ring Attention needs, per block, the output *and* its log-sum-exp, and a
backward that takes the global log-sum-exp. PyTorch's public
``scaled_dot_product_attention`` returns neither, but the fused ops under it
do, forward and backward; PyTorch's own context parallelism calls exactly
these per ring step. On the CPU: ``_scaled_dot_product_flash_attention_for_cpu``
(any float dtype, GQA native; float64 computed in float64, its lse too).
On CUDA: the flash kernel where PyTorch's own dispatcher says it can run
(half precision, GQA native), else the memory-efficient one (float32 too;
KV repeated for GQA and dK/dV summed back over the group). Where neither
serves (float64 on CUDA, say), the tiled array-API kernel runs in torch,
in float64 for float64. Inputs and outputs are
[batch, seq, heads, head_dim]; the kernels see [b, h, s, d] views.

A few queries over many keys (decode) on the CPU go to the tiled kernel
instead (``_few``), whose GQA folds the query heads a KV head serves into
the rows of one product: the CPU flash kernel works a query row at a time,
and it would have a narrower V padded, a copy of the whole cache.

A ``mask`` (packed documents, sliding windows) goes to the CPU kernel as an
additive bias; a row it hides wholly gets lse -inf (the kernel says 0). On
CUDA the flash kernel takes no mask: masked blocks (small: gathered short
documents, a window's edge tiles) run the tiled kernel in torch.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..namespace import accumulator_dtype
from . import tiled

aten = torch.ops.aten


def _heads_first(*tensors: torch.Tensor):
    return [t.transpose(1, 2) for t in tensors]


def _cuda_choice(q: torch.Tensor, k: torch.Tensor, causal: bool) -> Tuple[Optional[str], bool]:
    """(kernel, native GQA) that PyTorch's SDPA dispatcher accepts for these
    shapes, dtype and device: "flash", "efficient" or None."""
    qh, kh = _heads_first(q, k)
    gqa = q.shape[2] != k.shape[2]
    params = torch.backends.cuda.SDPAParams(qh, kh, kh, None, 0.0, causal, gqa)
    if torch.backends.cuda.can_use_flash_attention(params):
        return "flash", True
    if gqa:  # the efficient kernel wants one kv head per query head
        expanded = _repeat_kv(k, q.shape[2] // k.shape[2]).transpose(1, 2)
        params = torch.backends.cuda.SDPAParams(qh, expanded, expanded, None, 0.0, causal,
                                                False)
    if torch.backends.cuda.can_use_efficient_attention(params):
        return "efficient", False
    return None, False


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[b, s, hk, d] -> [b, s, hk * group, d], kv head i serving query heads
    i * group .. i * group + group - 1."""
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def _sum_groups(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of ``_repeat_kv``: [b, s, h, d] -> [b, s, kv_heads, d]."""
    b, s, h, d = grad.shape
    if h == kv_heads:
        return grad
    return grad.reshape(b, s, kv_heads, h // kv_heads, d).sum(dim=3)


def _bias(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The additive bias the CPU kernel takes for a boolean mask."""
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~mask, float("-inf"))


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float, mask: Optional[torch.Tensor] = None
            ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out [b, s, h, dv] in q's dtype, lse [b, h, s] in its accumulator
    dtype: float32, float64 for float64). PyTorch's fused kernels take one
    head size for q, k and v: where v's differs (multi-head latent
    attention: 192 against 128), the narrower side is padded with zero
    columns, which change neither a score (the scale is explicit) nor a real
    output column."""
    if _few(q, k, causal):
        return tiled.attention_forward(q, k, v, causal, scale, tile=MANY_KEYS, mask=mask)
    if v.shape[-1] != q.shape[-1]:
        width = max(q.shape[-1], v.shape[-1])
        out, lse = _forward(*(_padded(x, width) for x in (q, k, v)), causal, scale, mask)
        return out[..., :v.shape[-1]], lse
    return _forward(q, k, v, causal, scale, mask)


# at most this many queries over at least this many keys (a cache, not a
# ring's block); the tiled kernel then takes keys this many a tile (its
# square default is sized for many queries: a few queries' score tile
# stays small)
FEW_QUERIES, MANY_KEYS = 16, 1024


def _few(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether a few queries over many keys go to the tiled kernel: on the
    CPU, float32 or float64 (the tiled kernel answers in the accumulator's
    dtype, which is theirs), not causal (a causal block is a square)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)
            and not causal and q.shape[1] <= FEW_QUERIES and k.shape[1] >= MANY_KEYS)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
             scale: float, mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        bias = None if mask is None else _bias(mask, q)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            *_heads_first(q, k, v), 0.0, causal, attn_mask=bias, scale=scale)
        lse = lse.to(accumulator_dtype(q))  # float32 for 16-bit inputs already
        if mask is not None:
            lse = lse.masked_fill(~mask.any(dim=1), float("-inf"))
        return out.transpose(1, 2), lse
    if mask is not None:
        return tiled.attention_forward(q, k, v, causal, scale, mask=mask)
    choice, native_gqa = _cuda_choice(q, k, causal)
    if choice is None:
        return tiled.attention_forward(q, k, v, causal, scale)
    group = 1 if native_gqa else q.shape[2] // k.shape[2]
    qh, kh, vh = _heads_first(q, _repeat_kv(k, group), _repeat_kv(v, group))
    if choice == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal,
                                                            scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0,
                                                                causal, scale=scale)[:2]
        lse = lse[:, :, :q.shape[1]]  # padded to a multiple of 32 rows
    return out.transpose(1, 2), lse


def backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
             mask: Optional[torch.Tensor] = None
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtype; ``out`` and ``lse`` may be the
    global ones (over more keys than ``k`` holds). Unequal head sizes are
    padded as in ``forward`` (a zero column of dout or out adds nothing)."""
    if v.shape[-1] != q.shape[-1]:
        width = max(q.shape[-1], v.shape[-1])
        dq, dk, dv = _backward(*(_padded(x, width) for x in (dout, q, k, v, out)), lse,
                               causal, scale, mask)
        return dq[..., :q.shape[-1]], dk[..., :k.shape[-1]], dv[..., :v.shape[-1]]
    return _backward(dout, q, k, v, out, lse, causal, scale, mask)


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
              mask: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out = out.to(q.dtype)
    lse = lse.contiguous()
    if q.device.type == "cpu":  # it reads lse in its accumulation type
        lse = lse.to(accumulator_dtype(q))
        bias = None if mask is None else _bias(mask, q)
        if mask is not None:  # a row that saw no key: every exp(score - lse) is 0
            lse = lse.masked_fill(lse == float("-inf"), float("inf"))
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_heads_first(dout, q, k, v, out), lse, 0.0, causal, attn_mask=bias, scale=scale)
        return tuple(g.transpose(1, 2) for g in grads)
    if mask is not None:
        return tiled.attention_backward(dout, q, k, v, out, lse, causal, scale, mask=mask)
    choice, native_gqa = _cuda_choice(q, k, causal)
    if choice is None:
        return tiled.attention_backward(dout, q, k, v, out, lse, causal, scale)
    kv_heads, group = k.shape[2], 1 if native_gqa else q.shape[2] // k.shape[2]
    doh, qh, kh, vh, oh = _heads_first(dout, q, _repeat_kv(k, group), _repeat_kv(v, group), out)
    # no dropout: the random-state arguments are placeholders the kernels ignore
    if choice == "flash":
        seed = torch.empty(2, dtype=torch.uint64, device=q.device)
        offset = torch.empty((), dtype=torch.uint64, device=q.device)
        grads = aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lse, None, None, q.shape[1], k.shape[1], 0.0, causal,
            seed, offset, scale=scale)
    else:
        padded = torch.nn.functional.pad(lse, (0, -lse.shape[2] % 32))
        seed = torch.empty((), dtype=torch.long, device=q.device)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            doh, qh, kh, vh, None, oh, padded, seed, seed, 0.0, [True, True, True, False],
            causal, scale=scale)[:3]
    dq, dk, dv = (g.transpose(1, 2) for g in grads)
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)
