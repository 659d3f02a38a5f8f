"""Which queries see which keys: the attention mask of packed documents,
causality and a sliding window, as a few rectangular blocks to compute.

Query token (doc a, position i) sees key token (doc b, position j) when
a == b (never padding) and ``lo <= i - j <= hi``: ``lo`` = 0 under the
causal mask (and -right with a window), ``hi`` = the window's left reach.
``blocks(q_spans, k_spans, lo, hi)`` cuts the (local query, local key) plane
of two shards (``commlib.sequence.documents.Span`` lists) into blocks of one of
three kinds, which the block kernels run (keys before a query range and
keys from its diagonal on are cut apart, so that a query chunk against its
whole document is one full block and one causal one):

- ``full``: every pair visible (no mask);
- ``causal``: a square whose query i sees keys 0..i (the kernels' own
  causal mode);
- ``masked``: an explicit boolean mask [rows, cols].

Pairs nobody sees are never computed: a block exists only where some pair
is visible, trimmed to the visible rows and columns; a window's band is cut
into tiles, so that tiles wholly outside it are skipped; small blocks (short
documents) are gathered into one masked block of at most ``GROUP`` x
``GROUP`` so that a thousand short documents are not a thousand kernel
calls. Everything is computed once per shape on the host (cached) and is
the same on every rank, so it is static under ``jax.jit``.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

from .documents import PADDING, Span

UNBOUNDED = 1 << 62
TILE = 512   # a window's band is cut into tiles of this edge
GROUP = 256  # blocks are gathered while their bounding box stays this small


@dataclass(frozen=True)
class Block:
    """Local query rows [rows[0], rows[1]) against local key columns
    [cols[0], cols[1])."""

    rows: Tuple[int, int]
    cols: Tuple[int, int]
    kind: str                      # "full", "causal" or "masked"
    mask: Optional[np.ndarray]     # masked: bool [rows, cols], True = visible
    pairs: int                     # visible (query, key) pairs

    @property
    def row_slice(self) -> slice:
        return slice(*self.rows)

    @property
    def col_slice(self) -> slice:
        return slice(*self.cols)


def bounds(causal: bool, window: Any) -> Tuple[int, int]:
    """(lo, hi): the visible range of query position - key position.
    ``window`` = (left, right) tokens (None or -1: unbounded, flash-attn's
    convention), or None."""
    left = right = None
    if window is not None:
        try:
            left, right = window
        except (TypeError, ValueError):
            raise ValueError(f"window must be (left, right) tokens or None, got "
                             f"{window!r}") from None
        for name, reach in (("left", left), ("right", right)):
            if reach is not None and (isinstance(reach, bool) or not isinstance(reach, int)
                                      or reach < -1):
                raise ValueError(f"window {name} reach must be a token count >= 0 (or -1 / "
                                 f"None: unbounded), got {reach!r}")
        left = None if left == -1 else left
        right = None if right == -1 else right
    lo = -UNBOUNDED if right is None else -right
    if causal:
        lo = max(lo, 0)
    return lo, (UNBOUNDED if left is None else left)


@dataclass(frozen=True)
class _Rect:
    """A block before gathering: local rows/cols, kind, the positions (in
    their document, or global under a mask) of its first query and first
    key, and the band ``lo <= i - j <= hi`` a masked rect paints (or, for a
    mask's explicit block, its own ``pattern``)."""

    row0: int
    rows: int
    col0: int
    cols: int
    kind: str
    q_position: int = 0
    k_position: int = 0
    lo: int = 0
    hi: int = 0
    pattern: Optional[np.ndarray] = field(default=None, compare=False)

    def paint(self) -> np.ndarray:
        if self.kind == "full":
            return np.ones((self.rows, self.cols), bool)
        if self.kind == "causal":
            return np.tri(self.rows, self.cols, dtype=bool)
        if self.pattern is not None:
            return self.pattern
        gap = (self.q_position + np.arange(self.rows))[:, None] \
            - (self.k_position + np.arange(self.cols))[None, :]
        return (gap >= self.lo) & (gap <= self.hi)


def _runs(spans: Tuple[Span, ...]) -> List[Tuple[int, int, int, Tuple[Tuple[int, int, int], ...]]]:
    """Consecutive spans of one document in increasing positions, as
    (doc, local start, local stop, ((local start, position, length), ...)).
    Padding ends a run: a run's tokens are local neighbours (the hybrid's
    groups hold one document's chunks with padding between them)."""
    runs: List[Any] = []
    local = 0
    previous = None
    for span in spans:
        piece = (local, span.position, span.length)
        last = runs[-1] if runs else None
        if span.doc != PADDING and last is not None and previous is not None \
                and previous.doc == last[0] == span.doc and span.position > last[3][-1][1]:
            runs[-1] = (span.doc, last[1], local + span.length, last[3] + (piece,))
        elif span.doc != PADDING:
            runs.append((span.doc, local, local + span.length, (piece,)))
        local += span.length
        previous = span
    return runs


def _classify(row0: int, q_position: int, rows: int, col0: int, k_position: int, cols: int,
              lo: int, hi: int) -> List[_Rect]:
    """The visible part of one document's queries [q_position, +rows) against
    its keys [k_position, +cols): nothing, or trimmed rects."""
    first_q = max(q_position, k_position + lo)
    last_q = min(q_position + rows - 1, k_position + cols - 1 + hi)
    first_k = max(k_position, q_position - hi)
    last_k = min(k_position + cols - 1, q_position + rows - 1 - lo)
    if first_q > last_q or first_k > last_k:
        return []
    row0, col0 = row0 + first_q - q_position, col0 + first_k - k_position
    rows, cols = last_q - first_q + 1, last_k - first_k + 1
    if first_q - last_k >= lo and last_q - first_k <= hi:
        return [_Rect(row0, rows, col0, cols, "full")]
    if first_q - first_k == lo and rows == cols and hi >= lo + rows - 1:
        return [_Rect(row0, rows, col0, cols, "causal")]  # the square's own diagonal
    if first_k < first_q <= last_k:  # keys before the queries, then from the diagonal on
        before = first_q - first_k
        return (_classify(row0, first_q, rows, col0, first_k, before, lo, hi)
                + _classify(row0, first_q, rows, col0 + before, first_q, cols - before, lo, hi))
    if rows <= TILE and cols <= TILE:
        return [_Rect(row0, rows, col0, cols, "masked", first_q, first_k, lo, hi)]
    return [rect for r in range(0, rows, TILE) for c in range(0, cols, TILE)
            for rect in _classify(row0 + r, first_q + r, min(TILE, rows - r),
                                  col0 + c, first_k + c, min(TILE, cols - c), lo, hi)]


def _joined(rects: List[_Rect]) -> List[_Rect]:
    """Full rects side by side (same rows, adjacent columns, or the other
    way round) joined: fewer, larger kernel calls."""
    rects = list(rects)
    joined = True
    while joined:
        joined = False
        for i, a in enumerate(rects):
            for j, b in enumerate(rects):
                if i == j or a.kind != "full" or b.kind != "full":
                    continue
                if (a.row0, a.rows) == (b.row0, b.rows) and a.col0 + a.cols == b.col0:
                    rects[i] = _Rect(a.row0, a.rows, a.col0, a.cols + b.cols, "full")
                elif (a.col0, a.cols) == (b.col0, b.cols) and a.row0 + a.rows == b.row0:
                    rects[i] = _Rect(a.row0, a.rows + b.rows, a.col0, a.cols, "full")
                else:
                    continue
                del rects[j]
                joined = True
                break
            if joined:
                break
    return rects


def _rects(q_spans: Tuple[Span, ...], k_spans: Tuple[Span, ...], lo: int,
           hi: int) -> List[_Rect]:
    rects: List[_Rect] = []
    windowless = hi >= UNBOUNDED and lo in (0, -UNBOUNDED)
    for doc, q0, q1, q_pieces in _runs(q_spans):
        for k_doc, k0, k1, k_pieces in _runs(k_spans):
            if doc != k_doc:
                continue
            same = [p[1:] for p in q_pieces] == [p[1:] for p in k_pieces]
            if windowless and (same or lo < 0):  # a run's order is its positions' order
                kind = "causal" if lo == 0 else "full"
                rects.append(_Rect(q0, q1 - q0, k0, k1 - k0, kind))
                continue
            rects += _joined([rect for qs in q_pieces for ks in k_pieces
                              for rect in _classify(qs[0], qs[1], qs[2], ks[0], ks[1], ks[2],
                                                    lo, hi)])
    return sorted(rects, key=lambda r: (r.row0, r.col0))


def _block(rect: _Rect) -> Block:
    rows, cols = (rect.row0, rect.row0 + rect.rows), (rect.col0, rect.col0 + rect.cols)
    if rect.kind == "full":
        return Block(rows, cols, "full", None, rect.rows * rect.cols)
    if rect.kind == "causal":
        return Block(rows, cols, "causal", None, rect.rows * (rect.rows + 1) // 2)
    mask = rect.paint()
    return Block(rows, cols, "masked", mask, int(mask.sum()))


def _gathered(group: List[_Rect]) -> Block:
    """One masked block painting every rect of ``group`` (and nothing else
    of their bounding box: a pair another block holds is not counted twice)."""
    if len(group) == 1:
        return _block(group[0])
    row0, col0 = min(r.row0 for r in group), min(r.col0 for r in group)
    row1 = max(r.row0 + r.rows for r in group)
    col1 = max(r.col0 + r.cols for r in group)
    mask = np.zeros((row1 - row0, col1 - col0), bool)
    for r in group:
        mask[r.row0 - row0:r.row0 - row0 + r.rows, r.col0 - col0:r.col0 - col0 + r.cols] = \
            r.paint()
    return Block((row0, row1), (col0, col1), "masked", mask, int(mask.sum()))


@functools.lru_cache(maxsize=1024)
def blocks(q_spans: Tuple[Span, ...], k_spans: Tuple[Span, ...], lo: int,
           hi: int) -> Tuple[Block, ...]:
    """The blocks in which queries of ``q_spans`` see keys of ``k_spans``."""
    return _grouped(_rects(q_spans, k_spans, lo, hi))


@functools.lru_cache(maxsize=1024)
def mask_blocks(mask: Any, q_spans: Tuple[Span, ...],
                k_spans: Tuple[Span, ...]) -> Tuple[Block, ...]:
    """The blocks in which queries of ``q_spans`` see keys of ``k_spans``
    under ``mask`` (``commlib.sequence.masks.Mask``: slices of the GLOBAL sequence,
    read through the spans' ``origin``): each slice met by a query piece
    and a key piece is a band there, classified as ``blocks`` does; an
    explicit slice's piece is a masked block of its pattern."""
    q_pieces, k_pieces = _pieces(q_spans), _pieces(k_spans)
    starts = [part.q[0] for part in mask.slices]
    reach = max(part.q[1] - part.q[0] for part in mask.slices)
    rects: List[_Rect] = []
    for q_local, q_first, q_count in q_pieces:
        q_last = q_first + q_count
        first = bisect.bisect_left(starts, q_first - reach)
        for part in mask.slices[first:bisect.bisect_left(starts, q_last)]:
            if part.q[1] <= q_first:
                continue
            rows = (max(q_first, part.q[0]), min(q_last, part.q[1]))
            for k_local, k_first, k_count in k_pieces:
                cols = (max(k_first, part.k[0]), min(k_first + k_count, part.k[1]))
                if rows[0] >= rows[1] or cols[0] >= cols[1]:
                    continue
                row0, col0 = q_local + rows[0] - q_first, k_local + cols[0] - k_first
                if part.kind == "explicit":
                    pattern = part.pattern[rows[0] - part.q[0]:rows[1] - part.q[0],
                                           cols[0] - part.k[0]:cols[1] - part.k[0]]
                    if pattern.any():
                        rects.append(_Rect(row0, rows[1] - rows[0], col0, cols[1] - cols[0],
                                           "masked", pattern=pattern))
                    continue
                rects += _classify(row0, rows[0], rows[1] - rows[0], col0, cols[0],
                                   cols[1] - cols[0], *part.band)
    return _grouped(sorted(rects, key=lambda r: (r.row0, r.col0)))


def _pieces(spans: Tuple[Span, ...]) -> List[Tuple[int, int, int]]:
    """(local start, global origin, length) of the spans' real tokens."""
    out, local = [], 0
    for span in spans:
        if span.doc != PADDING:
            out.append((local, span.origin, span.length))
        local += span.length
    return out


def _grouped(rects: List[_Rect]) -> Tuple[Block, ...]:
    """Rects (sorted by rows) as blocks, small neighbours gathered into one
    masked block of at most ``GROUP`` x ``GROUP``."""
    result: List[Block] = []
    group: List[_Rect] = []
    box = None
    for rect in rects:
        if box is not None:
            grown = (min(box[0], rect.row0), min(box[1], rect.col0),
                     max(box[2], rect.row0 + rect.rows), max(box[3], rect.col0 + rect.cols))
            if grown[2] - grown[0] <= GROUP and grown[3] - grown[1] <= GROUP:
                group.append(rect)
                box = grown
                continue
            result.append(_gathered(group))
        group = [rect]
        box = (rect.row0, rect.col0, rect.row0 + rect.rows, rect.col0 + rect.cols)
    if group:
        result.append(_gathered(group))
    return tuple(result)


def band_blocks(q_positions: np.ndarray, k_positions: np.ndarray, lo: int,
                hi: int) -> Tuple[Block, ...]:
    """The blocks in which queries see keys of one sequence whose global
    positions are each in increasing order (a KV cache's keys, a chunk's
    queries): the query at position p sees the key at r when
    ``lo <= p - r <= hi``. Query i's keys are then one index range
    [first_i, last_i), both growing with i, so each tile of ``TILE`` query
    rows is the columns all its rows see (one full block: a decoded token's
    whole cache) and the ragged edges on either side (masked blocks, about
    as wide as the tile, or a window's edge). Computed on the host from the
    positions alone: the same on every rank that knows them."""
    q_positions = np.asarray(q_positions, np.int64)
    k_positions = np.asarray(k_positions, np.int64)
    first = np.searchsorted(k_positions, np.maximum(q_positions - hi, -UNBOUNDED), "left")
    last = np.searchsorted(k_positions, np.minimum(q_positions - lo, UNBOUNDED), "right")
    found: List[Block] = []
    for row0 in range(0, q_positions.size, TILE):
        rows = slice(row0, min(row0 + TILE, q_positions.size))
        begin, end = int(first[rows].min()), int(last[rows].max())
        if begin >= end:
            continue
        inner = (int(first[rows].max()), int(last[rows].min()))
        cuts = [(begin, inner[0]), inner, (inner[1], end)] if inner[0] < inner[1] \
            else [(begin, end)]
        for col0, col1 in cuts:
            if col0 >= col1:
                continue
            if (col0, col1) == inner:
                found.append(Block((rows.start, rows.stop), inner, "full", None,
                                   (rows.stop - rows.start) * (col1 - col0)))
                continue
            cols = np.arange(col0, col1)
            mask = (cols[None, :] >= first[rows, None]) & (cols[None, :] < last[rows, None])
            if mask.any():
                found.append(Block((rows.start, rows.stop), (col0, col1), "masked", mask,
                                   int(mask.sum())))
    return tuple(found)
