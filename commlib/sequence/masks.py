"""Any attention mask, as slices of the global sequence (MagiAttention's
``AttnSlice``): one small value type that the layout solver, the block
planner and the kernels all read.

A ``Slice(q, k, kind)`` covers queries ``q = (qs, qe)`` and keys
``k = (ks, ke)`` of the GLOBAL sequence. With ``a = i - qs``,
``b = j - ks``, ``lq = qe - qs`` and ``lk = ke - ks``, query i sees key j
when:

- ``full``: always;
- ``causal``: ``b <= a + lk - lq`` (bottom-right aligned, flash-attn's
  convention: the last query sees the last key);
- ``inv_causal``: ``b >= a`` (top-left aligned);
- ``bicausal``: both.

Each is a band on the distance ``i - j`` inside its rectangle:
``lo <= i - j <= hi`` with ``lo = qe - ke`` (causal, bicausal) and
``hi = qs - ks`` (inv_causal, bicausal), unbounded otherwise; that is what
``commlib.sequence.visibility`` cuts into kernel blocks. A ``Mask`` is their union;
slices whose rectangles overlap are refused. A query row that sees no key
gets output 0 and lse -inf, as padding does.

``from_mask_mod`` keeps what a FlexAttention ``mask_mod`` gives exactly:
blocks all visible become ``full`` slices, blocks that follow one of the
four kinds become that kind, and any other mixed block an ``Explicit``
slice holding its boolean pattern.
"""

from __future__ import annotations

import functools
import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import graph_names
from .visibility import UNBOUNDED, bounds

__all__ = ["Slice", "Explicit", "Mask", "KINDS", "from_cu_seqlens", "from_band", "from_mask_mod",
           "check_mask"]

KINDS = ("full", "causal", "inv_causal", "bicausal")


def _range(name: str, value: Any) -> Tuple[int, int]:
    """A (start, stop) pair of ints with 0 <= start < stop."""
    try:
        start, stop = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (start, stop) pair of token indices, got "
                         f"{value!r}") from None
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
               for x in (start, stop)):
        raise ValueError(f"{name} must hold integers, got {value!r}")
    if not 0 <= start < stop:
        raise ValueError(f"{name} must satisfy 0 <= start < stop (a non-empty range of the "
                         f"global sequence), got {value!r}")
    return int(start), int(stop)


@dataclass(frozen=True)
class Slice:
    """Queries ``q`` = (qs, qe) against keys ``k`` = (ks, ke) of the global
    sequence, visible by ``kind`` (see the module docstring)."""

    q: Tuple[int, int]
    k: Tuple[int, int]
    kind: str = "full"

    def __post_init__(self):
        object.__setattr__(self, "q", _range("Slice q", self.q))
        object.__setattr__(self, "k", _range("Slice k", self.k))
        if self.kind not in KINDS:
            raise ValueError(f"Slice kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def band(self) -> Tuple[int, int]:
        """(lo, hi): the visible range of ``i - j`` inside the rectangle."""
        (qs, qe), (ks, ke) = self.q, self.k
        lo = qe - ke if self.kind in ("causal", "bicausal") else -UNBOUNDED
        hi = qs - ks if self.kind in ("inv_causal", "bicausal") else UNBOUNDED
        return lo, hi

    def visible(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """bool [rows, cols]: which of these global (query, key) pairs it
        shows (False outside its rectangle)."""
        (qs, qe), (ks, ke) = self.q, self.k
        lo, hi = self.band
        gap = rows[:, None] - cols[None, :]
        return ((rows[:, None] >= qs) & (rows[:, None] < qe) & (cols[None, :] >= ks)
                & (cols[None, :] < ke) & (gap >= lo) & (gap <= hi))

    def pairs_in(self, rows: Tuple[int, int], cols: Tuple[int, int] = (0, UNBOUNDED)) -> int:
        """Visible pairs of queries ``rows`` against keys ``cols`` (global
        ranges), counted per row, without painting."""
        first, last = max(rows[0], self.q[0]), min(rows[1], self.q[1])
        if first >= last:
            return 0
        return int(self.row_counts(first, last, cols).sum())

    def row_counts(self, first: int, last: int,
                   cols: Tuple[int, int] = (0, UNBOUNDED)) -> np.ndarray:
        """Keys of ``cols`` that each query of [first, last) (inside the
        slice's rows) sees."""
        lo, hi = self.band
        left, right = max(cols[0], self.k[0]), min(cols[1], self.k[1])
        high = np.arange(first - lo + 1, last - lo + 1, dtype=np.int64)  # past each row's last key
        np.minimum(high, right, out=high)
        low = np.arange(first - hi, last - hi, dtype=np.int64)  # each row's first key
        np.maximum(low, left, out=low)
        high -= low
        return np.maximum(high, 0, out=high)


@dataclass(frozen=True)
class Explicit:
    """Queries ``q`` against keys ``k`` visible where ``pattern`` [qe-qs,
    ke-ks] is True: a mixed block of a ``mask_mod`` that none of the four
    kinds describes."""

    q: Tuple[int, int]
    k: Tuple[int, int]
    pattern: np.ndarray = field(repr=False, compare=False)
    digest: int = field(default=0, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "q", _range("Explicit q", self.q))
        object.__setattr__(self, "k", _range("Explicit k", self.k))
        pattern = np.ascontiguousarray(self.pattern, dtype=bool)
        if pattern.shape != (self.q[1] - self.q[0], self.k[1] - self.k[0]):
            raise ValueError(f"an Explicit block of queries {self.q} and keys {self.k} needs a "
                             f"pattern of shape {(self.q[1] - self.q[0], self.k[1] - self.k[0])}"
                             f", got {pattern.shape}")
        object.__setattr__(self, "pattern", pattern)
        object.__setattr__(self, "digest", zlib.crc32(pattern.tobytes()))

    kind = "explicit"

    def visible(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        (qs, qe), (ks, ke) = self.q, self.k
        inside = ((rows[:, None] >= qs) & (rows[:, None] < qe) & (cols[None, :] >= ks)
                  & (cols[None, :] < ke))
        r = np.clip(rows - qs, 0, qe - qs - 1)
        c = np.clip(cols - ks, 0, ke - ks - 1)
        return inside & self.pattern[np.ix_(r, c)]

    pairs_in = Slice.pairs_in  # through this class's row_counts

    def row_counts(self, first: int, last: int,
                   cols: Tuple[int, int] = (0, UNBOUNDED)) -> np.ndarray:
        c0, c1 = max(cols[0], self.k[0]) - self.k[0], min(cols[1], self.k[1]) - self.k[0]
        return self.pattern[first - self.q[0]:last - self.q[0], max(c0, 0):max(c1, 0)].sum(axis=1)


Part = Union[Slice, Explicit]


class Mask:
    """The union of ``slices`` (``Slice`` or ``Explicit``), none of whose
    rectangles overlap. ``length``: the global sequence it covers (default:
    the largest end of any slice); a query no slice covers sees nothing."""

    def __init__(self, slices: Iterable[Part], length: Optional[int] = None):
        parts = tuple(slices)
        for part in parts:
            if not isinstance(part, (Slice, Explicit)):
                raise ValueError(f"a Mask is made of Slice (or Explicit) values, got "
                                 f"{type(part).__name__}")
        if not parts:
            raise ValueError("a Mask needs at least one slice")
        self.slices = tuple(sorted(parts, key=lambda p: (p.q, p.k)))
        _refuse_overlaps(self.slices)
        end = max(max(p.q[1], p.k[1]) for p in self.slices)
        if length is not None and length < end:
            raise ValueError(f"the slices reach token {end - 1}, past the length {length}")
        self.length = end if length is None else int(length)
        slices = repr([(p.q, p.k, p.kind, getattr(p, "digest", 0)) for p in self.slices])
        self._text = f"{self.length}:{slices}"  # the content, once
        # equal masks share a name: a compiled graph retraces for another mask only
        self.handle = graph_names.name("mask", self, hashlib.blake2b(
            self._text.encode(), digest_size=16).hexdigest())

    def __repr__(self) -> str:
        return f"Mask({len(self.slices)} slices, length {self.length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Mask) and self.digest() == other.digest()

    def __hash__(self) -> int:
        return self.digest()

    def digest(self) -> int:
        """A CRC of the slices (what the ranks compare to agree)."""
        return zlib.crc32(self._text.encode())

    def dense(self) -> np.ndarray:
        """bool [length, length]: the mask written out (for references)."""
        index = np.arange(self.length)
        out = np.zeros((self.length, self.length), bool)
        for part in self.slices:
            out |= part.visible(index, index)
        return out

    def visible(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """bool [rows, cols] of the given global query and key indices."""
        out = np.zeros((len(rows), len(cols)), bool)
        for part in self.slices:
            if _meets(part.q, rows) and _meets(part.k, cols):
                out |= part.visible(np.asarray(rows), np.asarray(cols))
        return out

    def pairs_in(self, rows: Tuple[int, int], cols: Tuple[int, int] = (0, UNBOUNDED)) -> int:
        """Visible pairs of queries ``rows`` against keys ``cols``."""
        return sum(part.pairs_in(rows, cols) for part in self.slices
                   if part.q[0] < rows[1] and rows[0] < part.q[1]
                   and part.k[0] < cols[1] and cols[0] < part.k[1])

    def keys_seen(self, rows: Iterable[Tuple[int, int]]) -> np.ndarray:
        """bool [length]: the keys some query of the global ``rows`` ranges
        sees (``key_ranges`` painted)."""
        seen = np.zeros(self.length + 1, np.int64)
        starts, stops = self.key_ranges(rows)
        seen[starts] += 1
        seen[stops] -= 1
        return np.cumsum(seen[:-1]) > 0

    def key_ranges(self, rows: Iterable[Tuple[int, int]]) -> Tuple[np.ndarray, np.ndarray]:
        """(starts, stops): the keys some query of the global ``rows``
        ranges sees, as sorted disjoint ranges. A run of rows of a band
        slice sees one range of keys (its first row's first key to its last
        row's last), every (run, slice) pair at once; an explicit slice, the
        columns its pattern marks in those rows."""
        runs = np.array(list(rows), np.int64).reshape(-1, 2)
        bands = [p for p in self.slices if isinstance(p, Slice)]
        starts, stops = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        if bands and len(runs):
            q = np.array([p.q for p in bands], np.int64)
            k = np.array([p.k for p in bands], np.int64)
            lo, hi = np.array([p.band for p in bands], np.int64).T
            top = np.maximum(runs[:, :1], q[:, 0])
            bottom = np.minimum(runs[:, 1:], q[:, 1])
            start = np.maximum(k[:, 0], top - hi)
            stop = np.minimum(k[:, 1], bottom - lo)
            hit = (top < bottom) & (start < stop)
            starts.append(start[hit])
            stops.append(stop[hit])
        for part in self.slices:
            if isinstance(part, Slice):
                continue
            for first, last in runs.tolist():
                top, bottom = max(first, part.q[0]), min(last, part.q[1])
                if top < bottom:
                    hit = part.pattern[top - part.q[0]:bottom - part.q[0]].any(axis=0)
                    edges = np.flatnonzero(np.diff(np.r_[0, hit.astype(np.int8), 0]))
                    starts.append(part.k[0] + edges[0::2])
                    stops.append(part.k[0] + edges[1::2])
        return _merged(np.concatenate(starts), np.concatenate(stops))

    def row_counts(self) -> np.ndarray:
        """int64 [length]: the keys each query sees (its share of the work)."""
        counts = np.zeros(self.length, np.int64)
        for part in self.slices:
            counts[part.q[0]:part.q[1]] += part.row_counts(*part.q)
        return counts


def _merged(starts: np.ndarray, stops: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Ranges [starts, stops) as sorted disjoint ranges covering the same."""
    if starts.size == 0:
        return starts, stops
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)        # the furthest stop so far
    first = np.r_[True, starts[1:] > reach[:-1]]  # a range that begins a merged one
    last = np.r_[first[1:], True]                 # ... and one that ends it
    return starts[first], reach[last]


def covered(starts: np.ndarray, stops: np.ndarray, points: np.ndarray) -> np.ndarray:
    """How many positions below each of ``points`` the sorted disjoint
    ranges cover."""
    before = np.r_[0, np.cumsum(stops - starts)]
    index = np.searchsorted(starts, points, side="right")
    last = np.maximum(index - 1, 0)
    inside = np.clip(points - starts[last], 0, (stops - starts)[last]) if starts.size else 0
    return before[last] + np.where(index > 0, inside, 0)


def check_mask(mask: Any, length: Optional[int]) -> None:
    """``mask`` is a ``Mask`` of a sequence of ``length`` tokens (None: any)."""
    if not isinstance(mask, Mask):
        raise ValueError(f"mask must be a commlib.sequence.masks.Mask (slices of the global "
                         f"sequence), got {type(mask).__name__}")
    if length is not None and mask.length != length:
        raise ValueError(f"the mask covers {mask.length} tokens but the sequence has {length}: "
                         f"make the mask for the global sequence (Mask(slices, length=...))")


def _meets(span: Tuple[int, int], index: np.ndarray) -> bool:
    index = np.asarray(index)
    return bool(index.size) and span[0] <= int(index.max()) and int(index.min()) < span[1]


def _refuse_overlaps(parts: Sequence[Part]) -> None:
    """Slices (sorted by q) whose rectangles intersect are an error: the
    union would count a pair twice, or hide which kind it belongs to."""
    active: List[Part] = []
    for part in parts:
        active = [a for a in active if a.q[1] > part.q[0]]
        for other in active:
            if other.k[0] < part.k[1] and part.k[0] < other.k[1]:
                raise ValueError(f"mask slices overlap: queries {other.q} x keys {other.k} "
                                 f"and queries {part.q} x keys {part.k}; cut them apart")
        active.append(part)


def from_cu_seqlens(cu_seqlens: Sequence[int], *, causal: bool,
                    window: Any = None) -> Mask:
    """The mask of packed documents (``cu_seqlens``: flash-attn's offsets),
    causal or not, with a (left, right) sliding window inside each: at most
    three slices a document (rows whose window is cut by the document's
    start, by its end, or by neither)."""
    offsets = [int(x) for x in cu_seqlens]
    if len(offsets) < 2 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly, got {offsets}")
    return from_band(tuple(offsets), *bounds(causal, window))


@functools.lru_cache(maxsize=64)
def from_band(offsets: Tuple[int, ...], lo: int, hi: int) -> Mask:
    """Packed documents (``offsets``) in which query i sees key j of its
    own document when ``lo <= i - j <= hi`` (``visibility.bounds``)."""
    slices: List[Slice] = []
    for start, stop in zip(offsets, offsets[1:]):
        slices += _band_slices(start, stop, lo, hi)
    return Mask(slices, length=offsets[-1])


def _band_slices(start: int, stop: int, lo: int, hi: int) -> List[Slice]:
    """``lo <= i - j <= hi`` inside the square [start, stop)^2 as slices:
    rows whose band is cut on the left (by ``start``), on the right (by
    ``stop``), both, or neither."""
    out: List[Slice] = []
    cut_left = min(stop, max(start, start + hi)) if hi < UNBOUNDED else stop
    cut_right = max(start, min(stop, stop + lo)) if lo > -UNBOUNDED else start
    for first, last in sorted({(start, min(cut_left, cut_right)),
                               (min(cut_left, cut_right), max(cut_left, cut_right)),
                               (max(cut_left, cut_right), stop)}):
        if first >= last:
            continue
        left_cut, right_cut = last <= cut_left, first >= cut_right
        ks = start if left_cut else first - hi
        ke = stop if right_cut else last - lo
        ks, ke = max(ks, start), min(ke, stop)
        if ks >= ke:
            continue
        kind = {(True, True): "full", (True, False): "causal", (False, True): "inv_causal",
                (False, False): "bicausal"}[(left_cut, right_cut)]
        candidate = Slice((first, last), (ks, ke), kind)
        if candidate.pairs_in(candidate.q):
            out.append(candidate)
    return out


def from_mask_mod(mask_mod: Callable[..., Any], length: int, block: int = 128) -> Mask:
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` over a sequence of
    ``length``, evaluated block by block (``block`` x ``block``): blocks
    all hidden are dropped, blocks all visible become ``full`` slices,
    mixed blocks that are one of the other kinds become that kind, and the
    rest ``Explicit`` slices with their pattern: the mask is exact. Runs
    the mask_mod on torch tensors (FlexAttention's own) where torch is
    installed, else on NumPy arrays."""
    if length < 1 or block < 1:
        raise ValueError(f"from_mask_mod needs length >= 1 and block >= 1, got {length}, "
                         f"{block}")
    parts: List[Part] = []
    for q0 in range(0, length, block):
        q1 = min(q0 + block, length)
        rows = np.arange(q0, q1)
        cols = np.arange(length)
        grid = _evaluate(mask_mod, rows, cols)
        for k0 in range(0, length, block):
            k1 = min(k0 + block, length)
            pattern = grid[:, k0:k1]
            if pattern.any():
                parts.append(_as_part((q0, q1), (k0, k1), pattern))
    return Mask(parts, length=length)


def _evaluate(mask_mod: Callable[..., Any], rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """bool [rows, cols] of ``mask_mod`` (batch 0, head 0), broadcast."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        q = torch.as_tensor(rows)[:, None]
        k = torch.as_tensor(cols)[None, :]
        zero = torch.zeros((), dtype=torch.int64)
        result = mask_mod(zero, zero, q, k)
        return np.broadcast_to(np.asarray(torch.as_tensor(result).cpu(), bool),
                               (len(rows), len(cols))).copy()
    result = mask_mod(0, 0, rows[:, None], cols[None, :])
    return np.broadcast_to(np.asarray(result, bool), (len(rows), len(cols))).copy()


def _as_part(q: Tuple[int, int], k: Tuple[int, int], pattern: np.ndarray) -> Part:
    """The simplest slice that shows ``pattern`` over q x k exactly."""
    rows, cols = np.arange(*q), np.arange(*k)
    for kind in KINDS:
        for trimmed in _trims(q, k, pattern, kind):
            if np.array_equal(trimmed.visible(rows, cols), pattern):
                return trimmed
    return Explicit(q, k, pattern)


def _trims(q: Tuple[int, int], k: Tuple[int, int], pattern: np.ndarray,
           kind: str) -> Iterable[Slice]:
    """Slices of ``kind`` over the visible part's bounding box."""
    visible_rows = np.flatnonzero(pattern.any(axis=1))
    visible_cols = np.flatnonzero(pattern.any(axis=0))
    box_q = (q[0] + int(visible_rows[0]), q[0] + int(visible_rows[-1]) + 1)
    box_k = (k[0] + int(visible_cols[0]), k[0] + int(visible_cols[-1]) + 1)
    yield Slice(box_q, box_k, kind)
    if kind != "full":
        yield Slice(q, k, kind)
