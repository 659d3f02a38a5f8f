"""e4m3 with float32 scales: the FP8 format MoE dispatch (per 128-channel
block of a token, ``commlib.moe.quantize``) and the Ulysses wire (per batch
and head of a message, ``commlib.ulysses.wire``) both send.

Values sharing a scale are divided by ``scale = amax / 448``, amax being
their largest magnitude and 448 e4m3's largest finite value, so the largest
becomes ±448 and every value keeps e4m3's 3 mantissa bits: a round trip is
within 2**-4 of each value's magnitude (half an ulp) down to amax * 2**-15
(e4m3's smallest normal, 2**-6, times the scale), and within the subnormal
floor, 2**-10 * scale, below it. e4m3 is a floating-point format, so one
scale for many values costs precision only to values more than 2**15 below
their group's largest.

Everything is computed in float32 in the caller's framework and on its device
(NumPy with ml_dtypes' float8, torch, JAX); nothing is read on the host. NumPy
and torch on the CPU divide exactly. XLA (JAX) divides by a broadcast value,
and torch on CUDA by a Python number, as a multiplication by its reciprocal:
their scales can be one float32 ulp off amax / 448, and a value within an
ulp of a tie between two e4m3 values may round the other way. The round-trip
bound holds either way: the receiver multiplies by the scale that was sent.
"""

from __future__ import annotations

import importlib
from typing import Any, Tuple

from .namespace import float32, framework, namespace

E4M3_MAX = 448.0

_FP8_MODULES = {"numpy": "ml_dtypes", "torch": "torch", "jax": "jax.numpy"}


def fp8_dtype(like: Any, instead: str = "send the rows unquantized (quantize=None)") -> Any:
    """The float8_e4m3fn dtype of ``like``'s framework: ml_dtypes' for NumPy,
    ``torch.float8_e4m3fn``, ``jnp.float8_e4m3fn``. A TypeError for CuPy,
    which has no float8 type, and for a framework too old to have one, that
    ends with ``instead`` (what the caller can do without FP8)."""
    kind = framework(like)
    if kind == "cupy":
        raise TypeError(f"CuPy has no float8 type, so CuPy arrays cannot be quantized to FP8; "
                        f"pass torch CUDA tensors instead (torch.as_tensor shares a CuPy "
                        f"array's memory), or {instead}")
    module = importlib.import_module(_FP8_MODULES[kind])
    dtype = getattr(module, "float8_e4m3fn", None)
    if dtype is None:
        raise TypeError(f"this {kind} has no float8 type ({module.__name__}.float8_e4m3fn is "
                        f"missing); upgrade it (torch >= 2.1 has one), or {instead}")
    return dtype


def scaled_e4m3(x: Any, axes: Tuple[int, ...]) -> Tuple[Any, Any]:
    """``x`` as (e4m3 values of x's shape, float32 scales with ``axes``
    kept as 1): one scale per slice over ``axes``, ``amax / 448``, or 1
    where it is 0 (all zeros, or an amax so small that amax / 448
    underflows), so that such a slice comes back as exact zeros. A slice
    holding inf or NaN gets an inf or NaN scale and comes back as NaN:
    finding them would mean reading the values on the host."""
    xp = namespace(x)
    x32 = float32(x)
    scales = xp.max(xp.abs(x32), axis=axes, keepdims=True) / E4M3_MAX
    scales = xp.where(scales == 0, 1.0, scales)
    values = xp.clip(x32 / scales, -E4M3_MAX, E4M3_MAX)
    return xp.astype(values, fp8_dtype(x)), scales


def unscaled(values: Any, scales: Any, dtype: Any) -> Any:
    """``values * scales`` (scales broadcast against the values), computed in
    float32 and returned as ``dtype``: ``scaled_e4m3`` undone, up to e4m3's
    rounding."""
    xp = namespace(values)
    return xp.astype(float32(values) * float32(scales), dtype)
