"""commlib.moe.quantize: DeepSeek-V3 FP8 (e4m3 values, one float32 scale per
128 channels per token), single process.

Every check compares against NumPy computed here, from the input alone: the
scales as float64 amax / 448 rounded to float32, the e4m3 values as the
nearest point of e4m3's grid (every finite value, listed from the 256 bit
patterns), dequantized values as NumPy's float32 product. One test body runs in
every framework that has a float8 type (``arrayimpl``), on float32 and
bfloat16 input; CuPy, which has none, must be refused.
"""

import sys
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from commlib.moe.quantize import BLOCK, E4M3_MAX, dequantize_fp8, fp8_dtype, quantize_fp8

import arrayimpl

NUMPY = arrayimpl.IMPLS["numpy"]
IMPLS = arrayimpl.params(exclude=("cupy",))
SHAPES = [(4, 128), (3, 256), (5, 200), (2, 7168), (2, 3, 200), (0, 256)]

# e4m3fn's finite values, from all 256 bit patterns (0x7f and 0xff are NaN)
GRID = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                 .astype(np.float64))
GRID = GRID[np.isfinite(GRID)]
# NumPy and torch on the CPU divide exactly; XLA (JAX) and torch on CUDA may
# multiply by the reciprocal instead, one float32 ulp away
EXACT_DIVISION = ("numpy", "torch")
HALF_ULP = 2.0 ** -4     # 3 mantissa bits: half an ulp is at most 2**-4 of the value
SUBNORMAL_FLOOR = 2.0 ** -10  # half of the smallest subnormal, 2**-9


def fp8_of(impl):
    """The framework's e4m3 type, named here rather than asked of the module."""
    if impl.framework == "torch":
        import torch
        return torch.float8_e4m3fn
    if impl.framework == "jax":
        import jax.numpy as jnp
        return jnp.float8_e4m3fn
    return ml_dtypes.float8_e4m3fn


def dtype_of(impl, name):
    if impl.framework == "torch":
        import torch
        return getattr(torch, name)
    if impl.framework == "jax":
        import jax.numpy as jnp
        return getattr(jnp, name)
    return arrayimpl.DTYPES[name]


def read_fp8(impl, values):
    """e4m3 values as float64, read from their bits (not converted by the
    framework under test)."""
    if impl.framework == "torch":
        import torch
        values = values.view(torch.uint8).cpu().numpy()
    return np.asarray(values).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def blocks_of(a, block):
    """[..., H] -> [..., ceil(H / block), block], the short last block padded
    with zeros."""
    channels = a.shape[-1]
    count = -(-channels // block)
    padded = np.zeros(a.shape[:-1] + (count * block,), dtype=a.dtype)
    padded[..., :channels] = a
    return padded.reshape(a.shape[:-1] + (count, block))


def expected_scales(x, block):
    """float64 amax / 448, rounded to float32; 1 where that is 0."""
    scales = (np.abs(blocks_of(x.astype(np.float64), block)).max(axis=-1) / 448.0)
    scales = scales.astype(np.float32)
    scales[scales == 0] = 1
    return scales


def per_channel(scales, block, channels):
    return np.repeat(scales, block, axis=-1)[..., :channels]


def check_nearest(x, q, scales, block, exact=True):
    """Each e4m3 value is the grid point nearest to x / scale (clipped to
    ±448; either one at a tie, or, when the division may be inexact, within
    a few float32 ulps of a tie)."""
    scaled = np.clip(x.astype(np.float32) / per_channel(scales, block, x.shape[-1]),
                     -E4M3_MAX, E4M3_MAX)
    slack = 0.0 if exact else 4 * np.spacing(np.abs(scaled)).astype(np.float64)
    scaled = scaled.astype(np.float64)
    above = np.clip(np.searchsorted(GRID, scaled), 0, GRID.size - 1)
    below = np.clip(above - 1, 0, GRID.size - 1)
    nearest = np.minimum(np.abs(GRID[above] - scaled), np.abs(GRID[below] - scaled))
    assert np.isin(q, GRID).all()
    assert (np.abs(q - scaled) <= nearest + slack).all()
    if exact:
        np.testing.assert_array_equal(np.abs(q - scaled), nearest)


def check_scales(scales, expected, exact=True):
    if exact:
        np.testing.assert_array_equal(scales, expected)
    else:
        assert (np.abs(scales - expected) <= np.spacing(expected)).all()


def check_error_bound(x, back, scales, block):
    """|x - dequantized| <= 2**-4 |x| + 2**-10 scale, with float32's own
    rounding (x / scale, q * scale) as slack; so also <= 2**-4 amax + ..."""
    x = x.astype(np.float64)
    scale = per_channel(scales, block, x.shape[-1]).astype(np.float64)
    amax = per_channel(np.abs(blocks_of(x, block)).max(axis=-1), block, x.shape[-1])
    bound = HALF_ULP * np.abs(x) + SUBNORMAL_FLOOR * scale + 2.0 ** -20 * amax
    error = np.abs(x - back.astype(np.float64))
    assert (error <= bound).all(), f"worst excess {np.max(error - bound)}"


def sample(shape, rng, block=BLOCK):
    """Normal values with per-block magnitudes spread over 1e-3..1e3, some
    elements far below their block's largest (e4m3 subnormals), a zero
    block and a zero token."""
    channels = shape[-1]
    count = -(-channels // block)
    spread = per_channel(10.0 ** rng.uniform(-3, 3, shape[:-1] + (count,)), block, channels)
    x = rng.standard_normal(shape) * spread * 10.0 ** rng.uniform(-4, 0, shape)
    if x.size:
        x.reshape(-1, channels)[0, :block] = 0
        x.reshape(-1, channels)[-1] = 0
    return x.astype(np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_quantize_matches_numpy(impl, dtype, shape):
    x = impl.asarray(sample(shape, np.random.default_rng(len(shape) * 7 + shape[-1])), dtype)
    ref = impl.to_numpy(x).astype(np.float32)  # bfloat16 widens exactly
    values, scales = quantize_fp8(x)

    assert impl.is_native(values) and impl.is_native(scales)
    assert values.dtype == fp8_of(impl) and values.dtype == fp8_dtype(x)
    assert impl.dtype_name(scales) == "float32"
    count = -(-shape[-1] // BLOCK)
    assert tuple(values.shape) == shape and tuple(scales.shape) == shape[:-1] + (count,)

    q = read_fp8(impl, values)
    s = impl.to_numpy(scales)
    exact = impl.name in EXACT_DIVISION
    check_scales(s, expected_scales(ref, BLOCK), exact)
    check_nearest(ref, q, s, BLOCK, exact)

    # each block's largest magnitude maps to exactly +-448; zero blocks stay zero
    grouped, q_grouped = blocks_of(ref, BLOCK), blocks_of(q, BLOCK)
    top = np.argmax(np.abs(grouped), axis=-1)[..., None]
    peak = np.take_along_axis(grouped, top, axis=-1)[..., 0]
    q_peak = np.take_along_axis(q_grouped, top, axis=-1)[..., 0]
    np.testing.assert_array_equal(q_peak, np.sign(peak) * np.where(peak != 0, 448.0, 0.0))
    zero = (grouped == 0).all(axis=-1)
    if shape[0]:
        assert zero.any()
    assert (s[zero] == 1).all() and (q_grouped[zero] == 0).all()

    for name in ("float32", "bfloat16"):
        back = dequantize_fp8(values, scales, dtype_of(impl, name))
        assert impl.is_native(back) and impl.dtype_name(back) == name
        product = q.astype(np.float32) * per_channel(s, BLOCK, shape[-1])
        expected = product.astype(arrayimpl.DTYPES[name]).astype(np.float32)
        np.testing.assert_array_equal(impl.to_numpy(back), expected)
        if name == "float32":
            check_error_bound(ref, impl.to_numpy(back), s, BLOCK)


@pytest.mark.parametrize("block", [1, 32, 100])
def test_other_block_sizes(block):
    x = sample((3, 250), np.random.default_rng(block), block)
    values, scales = quantize_fp8(x, block=block)
    assert scales.shape == (3, -(-250 // block))
    np.testing.assert_array_equal(scales, expected_scales(x, block))
    check_nearest(x, read_fp8(NUMPY, values), scales, block)
    check_error_bound(x, dequantize_fp8(values, scales, np.float32, block=block), scales, block)


@settings(max_examples=150, deadline=None)
@given(leading=hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6),
       channels=st.integers(1, 600), block=st.sampled_from([1, 7, 64, 128]),
       magnitude=st.floats(-6, 4), seed=st.integers(0, 2 ** 32 - 1))
def test_error_bound_property(leading, channels, block, magnitude, seed):
    """Random shapes (a bare [H] row, empty batches, middle axes) and
    blocks; block magnitudes around 10**magnitude (1e-6..1e4) with three
    decades of spread, elements down to 1e-4 of their block's largest."""
    shape = leading + (channels,)
    rng = np.random.default_rng(seed)
    count = -(-channels // block)
    spread = 10.0 ** (magnitude + rng.uniform(-1.5, 1.5, shape[:-1] + (count,)))
    x = (rng.standard_normal(shape) * per_channel(spread, block, channels)
         * 10.0 ** rng.uniform(-4, 0, shape)).astype(np.float32)
    values, scales = quantize_fp8(x, block=block)
    np.testing.assert_array_equal(scales, expected_scales(x, block))
    check_nearest(x, read_fp8(NUMPY, values), scales, block)
    check_error_bound(x, dequantize_fp8(values, scales, np.float32, block=block), scales, block)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_blocks_dequantize_to_nan(impl):
    a = np.ones((3, 256), dtype=np.float32)
    a[0, 5], a[1, 200] = np.inf, np.nan
    values, scales = quantize_fp8(impl.asarray(a))
    s = impl.to_numpy(scales)
    assert s[0, 0] == np.inf and np.isnan(s[1, 1])
    np.testing.assert_array_equal(np.delete(s.ravel(), [0, 3]), np.float32(1 / 448))
    back = impl.to_numpy(dequantize_fp8(values, scales, dtype_of(impl, "float32")))
    assert np.isnan(back[0, :128]).all() and np.isnan(back[1, 128:]).all()
    assert (back[0, 128:] == 1).all() and (back[1, :128] == 1).all() and (back[2] == 1).all()


def test_tiny_block_whose_scale_underflows_gets_scale_one():
    x = np.zeros((1, 128), dtype=np.float32)
    x[0, 3] = np.float32(1e-44)  # a float32 subnormal: 1e-44 / 448 rounds to 0
    values, scales = quantize_fp8(x)
    assert scales[0, 0] == 1 and (read_fp8(NUMPY, values) == 0).all()


BAD_QUANTIZE = [
    (lambda: (np.arange(256).reshape(2, 128), BLOCK), "floating-point.*int64"),
    (lambda: (np.zeros((2, 128), ml_dtypes.float8_e4m3fn), BLOCK),
     "floating-point.*float8_e4m3fn"),
    (lambda: (np.zeros((2, 128), bool), BLOCK), "floating-point.*bool"),
    (lambda: (np.float32(3).reshape(()), BLOCK), "0-d array; reshape"),
    (lambda: (np.zeros((2, 128), np.float32), 0), "at least 1 channel, got 0"),
    (lambda: (np.zeros((2, 128), np.float32), -4), "at least 1 channel, got -4"),
    (lambda: (np.zeros((2, 128), np.float32), 2.5), "block must be an integer"),
]


@pytest.mark.parametrize("make, message", BAD_QUANTIZE, ids=[m for _, m in BAD_QUANTIZE])
def test_quantize_rejects(make, message):
    x, block = make()
    with pytest.raises(ValueError, match=message):
        quantize_fp8(x, block=block)


@pytest.mark.parametrize("impl", IMPLS)
def test_dequantize_rejects(impl):
    values, scales = quantize_fp8(impl.asarray(np.ones((2, 200), np.float32)))
    f32 = dtype_of(impl, "float32")
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\).*got \(2, 1\)"):
        dequantize_fp8(values, scales[:, :1], f32)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 4\).*blocks of 64"):
        dequantize_fp8(values, scales, f32, block=64)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\).*got \(2,\)"):
        dequantize_fp8(values, scales[:, 0], f32)
    with pytest.raises(ValueError, match="values must be float8_e4m3fn.*got float32"):
        dequantize_fp8(scales, scales, f32)
    with pytest.raises(ValueError, match="at least 1 channel"):
        dequantize_fp8(values, scales, f32, block=0)
    if impl.framework != "numpy":
        with pytest.raises(ValueError, match=f"scales must be a {impl.framework} array"):
            dequantize_fp8(values, np.ones((2, 2), np.float32), f32)


def cupy_stand_in(monkeypatch):
    """An array that commlib.namespace takes for CuPy's, without CuPy: a
    ``cupy`` module whose ``ndarray`` it is an instance of."""
    module = types.ModuleType("cupy")

    class ndarray:
        dtype, shape, ndim = np.dtype(np.float32), (2, 128), 2

    module.ndarray = ndarray
    monkeypatch.setitem(sys.modules, "cupy", module)
    return ndarray()


def test_cupy_is_refused(monkeypatch):
    x = cupy_stand_in(monkeypatch)
    for call in (lambda: fp8_dtype(x), lambda: quantize_fp8(x)):
        with pytest.raises(TypeError, match="CuPy has no float8 type.*torch CUDA tensors"):
            call()


@pytest.mark.parametrize("impl", arrayimpl.params(["cupy"]))
def test_real_cupy_is_refused(impl):
    with pytest.raises(TypeError, match="CuPy has no float8 type"):
        quantize_fp8(impl.asarray(np.ones((2, 128), np.float32)))


def test_torch_without_float8_is_refused(monkeypatch):
    import torch
    x = torch.ones(2, 128)
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(TypeError, match="torch has no float8 type.*upgrade"):
        quantize_fp8(x)
