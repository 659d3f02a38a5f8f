"""The framework-neutral kernels of ``commlib.namespace`` against NumPy's
own slow but plain definitions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib.namespace import sum_rows, zeroed_rows

import arrayimpl
import requires


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), targets=st.integers(1, 6), width=st.integers(1, 5),
       spare=st.integers(0, 200), scaled=st.booleans(), seed=st.integers(0, 2**16))
def test_sum_rows_is_np_add_at_even_when_one_row_takes_hundreds(rows, targets, width,
                                                                  spare, scaled, seed):
    """Repeated indices accumulate, whatever their number: a fixed
    capacity's padding sends ``spare`` rows to one spare index, which the
    NumPy path sums at once past its first rounds."""
    rng = np.random.default_rng(seed)
    index = np.r_[rng.integers(0, targets, rows), np.full(spare, targets)]
    rng.shuffle(index)
    values = rng.standard_normal((index.size, width)).astype(np.float32)
    scale = rng.random(index.size).astype(np.float32) if scaled else None
    expected = np.zeros((targets + 1, width), np.float64)
    np.add.at(expected, index, values.astype(np.float64)
              * (1.0 if scale is None else scale[:, None]))
    out = sum_rows(values, index, targets + 1, scale=scale)
    assert np.allclose(out, expected, rtol=1e-5, atol=1e-4)
    picked = rng.permutation(index.size)  # rows=: the terms taken from elsewhere in values
    out = sum_rows(values[np.argsort(picked)], index, targets + 1, scale=scale, rows=picked)
    assert np.allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_sum_rows_in_torch_matches_numpy():
    torch = requires.module("torch")
    rng = np.random.default_rng(1)
    index = np.r_[rng.integers(0, 3, 50), np.full(300, 3)]
    values = rng.standard_normal((index.size, 4)).astype(np.float32)
    numpy_sum = sum_rows(values, index, 4)
    torch_sum = sum_rows(torch.from_numpy(values).bfloat16(), torch.from_numpy(index), 4,
                         dtype=torch.float32)
    assert np.allclose(torch_sum.numpy(), numpy_sum, atol=0.5)  # bfloat16 inputs


def test_sum_rows_in_torch_slices_adds_the_terms_of_one_index_add(monkeypatch):
    """On the CPU torch's terms are made a few rows at a time (no temporary
    the size of all of them); a row's terms fall in several slices, and the
    sums are still one ``index_add_`` of every term made at once, bit for
    bit (gathered, converted from bfloat16, scaled)."""
    torch = requires.module("torch")
    from commlib import namespace

    monkeypatch.setattr(namespace, "_SLICE_BYTES", 3 * 5 * 4)  # 3 float32 rows of 5
    rng = np.random.default_rng(2)
    index = torch.from_numpy(rng.integers(0, 4, 41))
    values = torch.from_numpy(rng.standard_normal((41, 5)).astype(np.float32)).bfloat16()
    picked = torch.from_numpy(rng.permutation(41))
    scale = torch.from_numpy(rng.random(41).astype(np.float32))
    terms = values.index_select(0, picked).float() * scale[:, None]
    expected = torch.zeros(4, 5).index_add_(0, index, terms)
    out = sum_rows(values, index, 4, scale=scale, rows=picked, dtype=torch.float32)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("impl", arrayimpl.params())
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64", "int32"])
def test_zeroed_rows_zero_nan_rows_bit_for_bit_and_keep_the_rest(impl, dtype):
    """The rows not kept become +0 even where they held NaN or inf (a
    padded expert row may; NaN times a zero weight would stay NaN); the
    kept ones keep every bit."""
    if dtype == "bfloat16" and impl.framework == "cupy":
        pytest.skip("CuPy has no bfloat16")
    rng = np.random.default_rng(2)
    values = rng.standard_normal((6, 3, 2)).astype(arrayimpl.DTYPES[dtype])
    if dtype != "int32":
        values[1] = np.nan
        values[4, 0] = np.inf
    keep = np.array([True, False, True, True, False, True])
    out = impl.to_numpy(zeroed_rows(impl.asarray(values.copy(), dtype), impl.asarray(keep)))
    expected = np.where(keep[:, None, None], values, 0).astype(values.dtype)
    assert out.tobytes() == expected.astype(out.dtype).tobytes()  # (to_numpy widens bfloat16)
