"""The all-to-all workload that ``alltoallv`` and ``reliability`` both time:
sizes, per-rank send counts (uniform or skewed), rows that cannot be
misplaced unseen, and the mpi4py exchange a careful user writes by hand."""

from __future__ import annotations

import re
from typing import Callable, Tuple

import numpy as np
from mpi4py import MPI

ROW_FLOATS = 256
ROW_BYTES = ROW_FLOATS * 4
SKEW_EXPONENT = 2.0          # share of a rank's k-th favourite destination ~ 1 / k**2

# A contender: (rows, send counts) -> (received rows, receive counts)
Exchange = Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int:
    """'4096', '4K', '4KiB', '64M' -> bytes (binary units: the table speaks KiB/MiB)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", str(text).lower())
    if match is None:
        raise ValueError(f"not a size: {text!r}; write e.g. 4096, 4K, 4KiB or 64MiB")
    return int(match.group(1)) * _UNITS[match.group(2)]


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def split_rows(rows: int, weights: np.ndarray) -> np.ndarray:
    """``rows`` split in proportion to ``weights``, as int64 summing exactly to
    ``rows`` (largest remainder), so every pattern moves the same bytes."""
    exact = rows * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    short = rows - int(counts.sum())
    counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
    return counts


def send_counts(pattern: str, rows: int, size: int, rank: int, seed: int) -> np.ndarray:
    """Rows this rank sends to each rank. ``skewed`` ranks destinations in a
    per-rank seeded order and gives the k-th one a share ~ 1/k**2, so hot
    destinations differ between ranks and may collide, as real routing does."""
    if pattern == "uniform":
        return split_rows(rows, np.ones(size))
    order = np.random.default_rng([seed, rank]).permutation(size)
    weights = np.empty(size)
    weights[order] = 1.0 / np.arange(1, size + 1) ** SKEW_EXPONENT
    return split_rows(rows, weights)


def make_rows(rows: int, rank: int) -> np.ndarray:
    """Rows whose first element is a global row id, so that a misplaced row
    cannot compare equal."""
    x = np.empty((rows, ROW_FLOATS), dtype=np.float32)
    x[:] = np.arange(ROW_FLOATS, dtype=np.float32)
    x[:, 0] = rank * rows + np.arange(rows)
    return x


def mpi4py_exchange(comm: MPI.Comm) -> Exchange:
    """What a careful user writes without commlib: the baseline to be within 10% of."""
    def exchange(x, counts):
        recv = np.empty_like(counts)
        comm.Alltoall(counts, recv)
        out = np.empty((int(recv.sum()),) + x.shape[1:], dtype=x.dtype)
        row_bytes = x[:1].nbytes
        send_bytes, recv_bytes = counts * row_bytes, recv * row_bytes
        comm.Alltoallv([x, (send_bytes, _displacements(send_bytes)), MPI.BYTE],
                       [out, (recv_bytes, _displacements(recv_bytes)), MPI.BYTE])
        return out, recv
    return exchange


def _displacements(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each rank's block starts."""
    return np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64)
