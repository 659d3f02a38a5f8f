"""FP8 activations for MoE dispatch, in DeepSeek-V3's format (the one DeepEP
sends): e4m3 values with one float32 scale per 128 channels per token.

Why: an e4m3 row is half of bf16's bytes on the wire, plus 4 bytes of scale
per 128 channels (a 7168-channel token: 7168 + 224 bytes instead of 14336).
Each block of a token is divided by ``scale = amax / 448``, amax being the
block's largest magnitude and 448 e4m3's largest finite value, so the largest
element becomes ±448 and every element keeps e4m3's 3 mantissa bits: a round
trip is within 2**-4 of each element's magnitude (half an ulp), or within
e4m3's subnormal floor, 2**-10 * scale, for elements far below amax.

Everything is computed in float32 in the caller's framework and on its device
(NumPy with ml_dtypes' float8, torch, JAX); nothing is read on the host. NumPy
and torch on the CPU divide exactly. XLA (JAX) divides by a broadcast value,
and torch on CUDA by a Python number (so DeepEP's own torch reference too), as
a multiplication by its reciprocal: their scales can be one float32 ulp off
amax / 448, and a value within an ulp of a tie between two e4m3 values may
round the other way. The round-trip bound holds either way: the receiver
multiplies by the scale that was sent.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any, Tuple

from ..namespace import device, dtype_name, float32, framework, framework_of, namespace

BLOCK = 128
E4M3_MAX = 448.0
INPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")

_FP8_MODULES = {"numpy": "ml_dtypes", "torch": "torch", "jax": "jax.numpy"}


def fp8_dtype(like: Any) -> Any:
    """The float8_e4m3fn dtype of ``like``'s framework: ml_dtypes' for NumPy,
    ``torch.float8_e4m3fn``, ``jnp.float8_e4m3fn``. A TypeError for CuPy,
    which has no float8 type, and for a framework too old to have one."""
    kind = framework(like)
    if kind == "cupy":
        raise TypeError("CuPy has no float8 type, so CuPy arrays cannot be quantized to FP8; "
                        "pass torch CUDA tensors instead (torch.as_tensor shares a CuPy "
                        "array's memory), or send the rows unquantized (quantize=None)")
    module = importlib.import_module(_FP8_MODULES[kind])
    dtype = getattr(module, "float8_e4m3fn", None)
    if dtype is None:
        raise TypeError(f"this {kind} has no float8 type ({module.__name__}.float8_e4m3fn is "
                        f"missing); upgrade it (torch >= 2.1 has one), or send the rows "
                        f"unquantized (quantize=None)")
    return dtype


def quantize_fp8(x: Any, block: int = BLOCK) -> Tuple[Any, Any]:
    """``x`` [T, ..., H] (float32, bfloat16, float16 or float64) as e4m3
    ``values`` [T, ..., H] and float32 ``scales`` [T, ..., ceil(H / block)],
    blocks running along the last axis, in x's framework and on its device.

    Per block: ``scale = amax / 448``, ``values = x / scale`` clipped to
    ±448 and rounded to the nearest e4m3. A block whose scale is 0 (all
    zeros, or so small that amax / 448 underflows float32) gets scale 1, so
    it dequantizes to exact zeros without a division by zero. When H is not
    a multiple of ``block``, the last block is shorter (DeepEP's kernels
    need multiples of 128; this reference does not). A block holding inf or
    NaN gets an inf or NaN scale and dequantizes to NaN: finding them would
    mean reading the values on the host.
    """
    fp8 = fp8_dtype(x)
    block = _check_block(block)
    if dtype_name(x) not in INPUT_DTYPES:
        raise ValueError(f"x must be a floating-point array ({', '.join(INPUT_DTYPES)}), got "
                         f"{dtype_name(x)}; quantize activations, not indices or already "
                         f"quantized values")
    if x.ndim == 0:
        raise ValueError("x must have a channel axis (blocks run along the last axis), got a "
                         "0-d array; reshape it to [1, 1]")
    xp = namespace(x)
    rows, channels = tuple(x.shape[:-1]), x.shape[-1]
    blocks = _num_blocks(channels, block)
    x32 = float32(x)
    if blocks * block != channels:  # pad the short last block with zeros
        pad = xp.zeros(rows + (blocks * block - channels,), dtype=xp.float32, device=device(x))
        x32 = xp.concat([x32, pad], axis=-1)
    grouped = xp.reshape(x32, rows + (blocks, block))
    scales = xp.max(xp.abs(grouped), axis=-1) / E4M3_MAX
    scales = xp.where(scales == 0, 1.0, scales)
    values = xp.clip(grouped / scales[..., None], -E4M3_MAX, E4M3_MAX)
    values = xp.reshape(values, rows + (blocks * block,))[..., :channels]
    return xp.astype(values, fp8), scales


def dequantize_fp8(values: Any, scales: Any, dtype: Any, block: int = BLOCK) -> Any:
    """``values * scale`` per block, computed in float32 and returned as
    ``dtype`` (a dtype of values' framework): the inverse of
    ``quantize_fp8(x, block)`` up to e4m3's rounding."""
    block = _check_block(block)
    framework_of("values", values)  # a ValueError for a list or other non-array
    if dtype_name(values) != "float8_e4m3fn":
        raise ValueError(f"values must be float8_e4m3fn (quantize_fp8's values), got "
                         f"{dtype_name(values)}")
    if framework_of("scales", scales) != framework(values):
        raise ValueError(f"scales must be a {framework(values)} array like values, got a "
                         f"{framework(scales)} array")
    if values.ndim == 0:
        raise ValueError("values must have a channel axis, got a 0-d array")
    channels = values.shape[-1]
    expected = tuple(values.shape[:-1]) + (_num_blocks(channels, block),)
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales must have shape {expected} (values' shape "
                         f"{tuple(values.shape)} with the last axis in blocks of {block}), got "
                         f"{tuple(scales.shape)}; pass the scales quantize_fp8 returned, with "
                         f"the same block")
    xp = namespace(values)
    per_channel = xp.repeat(float32(scales), block, axis=-1)[..., :channels]
    return xp.astype(float32(values) * per_channel, dtype)


def _check_block(block: Any) -> int:
    try:
        block = operator.index(block)
    except TypeError:
        raise ValueError(f"block must be an integer, got {block!r}") from None
    if block < 1:
        raise ValueError(f"block must be at least 1 channel, got {block}; DeepSeek-V3 and "
                         f"DeepEP use {BLOCK}")
    return block


def _num_blocks(channels: int, block: int) -> int:
    return -(-channels // block)
