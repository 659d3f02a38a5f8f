"""Validation of per-rank row counts for ``alltoallv``."""

from __future__ import annotations

from typing import Any

import numpy as np

from .dlpack import unwrap


def as_counts(name: str, counts: Any, size: int) -> np.ndarray:
    """``counts`` (a list, or any 1-D integer array, host or device) as a host
    int64 array of ``size`` non-negative entries, or a ValueError that says
    what is wrong."""
    if type(counts) is np.ndarray and counts.dtype == np.int64 and counts.shape == (size,) \
            and min(counts.tolist(), default=0) >= 0:
        return counts  # the common case, checked without conversions (nor NumPy reductions)
    try:
        native = unwrap(counts)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of {size} integers, "
                         f"got {type(counts).__name__}") from None
    host = native.data.get() if native.on_device else native.data
    if host.ndim != 1 or host.shape[0] != size:
        raise ValueError(f"{name} must have one entry per rank ({size}), "
                         f"got shape {tuple(host.shape)}")
    if host.dtype.kind not in "iu":
        raise ValueError(f"{name} must be integers (rows to send to each rank), "
                         f"got dtype {host.dtype}: {host.tolist()}; "
                         f"convert with .astype(int64) if the values are whole")
    values = host.astype(np.int64)
    if host.dtype.kind == "u" and (host > np.iinfo(np.int64).max).any():
        raise ValueError(f"{name} has entries too large for int64: {host.tolist()}")
    if (values < 0).any():
        raise ValueError(f"{name} must be non-negative, got {values.tolist()}")
    return values


def check_rows(name: str, counts: np.ndarray, rows: int) -> None:
    total = sum(counts.tolist())
    if total != rows:
        raise ValueError(f"{name} sums to {total} rows but x has {rows} rows along "
                         f"axis 0; counts must cover every row exactly once")
