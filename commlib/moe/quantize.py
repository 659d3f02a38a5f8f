"""FP8 activations for MoE dispatch, in DeepSeek-V3's format (the one DeepEP
sends): e4m3 values with one float32 scale per 128 channels per token.

Why: an e4m3 row is half of bf16's bytes on the wire, plus 4 bytes of scale
per 128 channels (a 7168-channel token: 7168 + 224 bytes instead of 14336).
Each block of a token gets its own scale; the format, its rounding and its
round-trip bound are ``commlib.fp8``'s.
"""

from __future__ import annotations

import operator
from typing import Any, Tuple

from ..fp8 import E4M3_MAX as E4M3_MAX  # where callers found it before commlib.fp8
from ..fp8 import fp8_dtype, scaled_e4m3, unscaled
from ..namespace import device, dtype_name, float32, framework, framework_of, namespace

BLOCK = 128
INPUT_DTYPES = ("float32", "bfloat16", "float16", "float64")


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
    fp8_dtype(x)  # CuPy's and a float8-less framework's refusal, first
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
    values, scales = scaled_e4m3(xp.reshape(x32, rows + (blocks, block)), (-1,))
    return xp.reshape(values, rows + (blocks * block,))[..., :channels], scales[..., 0]


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
    return unscaled(values, xp.repeat(float32(scales), block, axis=-1)[..., :channels], dtype)


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
