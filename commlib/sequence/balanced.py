"""The ``balanced`` layout: a mask's work spread evenly over the ranks.

The global sequence is cut into chunks of ``chunk`` tokens (the last one
shorter) and padded to a whole number of chunks per rank, so every shard
has one length; a solver assigns the chunks to ranks (MagiAttention's
dispatch solver, PyTorch CP's load balancer over a block mask):

- a chunk's work is the visible (query, key) pairs of its queries
  (``Mask.pairs_in``, counted in closed form per slice);
- chunks go heaviest first, each to a rank that still has room and the
  least work so far (LPT scheduling, which keeps the busiest rank within
  one chunk's work of the mean);
- among the ranks within ``SLACK`` of that least work, the one that already
  holds a neighbouring chunk: neighbours' queries tend to see the same keys
  (a document, a causal prefix), so a rank of neighbours receives fewer
  K/V bytes;
- the plain contiguous cut (rank r the r-th of ``size`` near-equal runs of
  chunks) competes with that schedule: of the two, those within ``TOLERANCE`` of the mean work,
  the one whose busiest rank receives the fewest keys its queries see
  (``Mask.keys_seen``) wins; neither within it, the better balanced. Equal
  chunks (documents, a block-diagonal mask) would otherwise be dealt out
  one by one to alternating ranks, every document cut across all of them.

Deterministic (ties to the lower rank): every rank computes the same
assignment from the mask alone, without communication. A rank's chunks
sit in its shard in sequence order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from .documents import (
    PADDING,
    Span,
    check_layout,
    joined_spans,
    needed_length,
    packing_for,
    spans_in_order,
)
from .masks import covered

__all__ = ["Assigned", "solve", "chunk_size", "loads", "held_ranges", "placement_for", "SLACK",
           "TOLERANCE"]

# how close to the least-loaded rank another rank may be to win a chunk
# for holding its neighbour: a fraction of the mean work of a chunk
SLACK = 0.25
# a placement whose busiest rank's work is within this of the mean is
# balanced; among those, the fewer K/V bytes win
TOLERANCE = 0.05
# the largest default chunk; a short sequence gets smaller ones, at least
# CHUNKS_PER_RANK a rank
MOST_CHUNK = 512
CHUNKS_PER_RANK = 8


@dataclass(frozen=True)
class Assigned:
    """A sequence of ``length`` tokens in chunks of ``chunk``, rank r
    holding ``chunks[r]`` (in sequence order), each shard padded to
    ``local_length``: a placement (``spans``, ``in_order``) as
    ``commlib.sequence.documents.Packing`` is, for the attention's schedules."""

    length: int
    chunk: int
    chunks: Tuple[Tuple[int, ...], ...]
    local_length: int
    layout: str = "balanced"

    @property
    def size(self) -> int:
        return len(self.chunks)

    @property
    def offsets(self) -> Tuple[int, int]:
        return (0, self.length)

    def spans(self, rank: int) -> Tuple[Span, ...]:
        return _spans(self, rank)

    def all_spans(self) -> Tuple[Span, ...]:
        return tuple(s for rank in range(self.size) for s in self.spans(rank))

    def in_order(self) -> Tuple[np.ndarray, Tuple[Span, ...]]:
        return spans_in_order(self)


@functools.lru_cache(maxsize=256)
def _spans(placement: Assigned, rank: int) -> Tuple[Span, ...]:
    spans: List[Span] = []
    for c in placement.chunks[rank]:
        start = c * placement.chunk
        stop = min(start + placement.chunk, placement.length)
        if stop > start:
            spans.append(Span(0, start, stop - start, start))
    held = sum(s.length for s in spans)
    if placement.local_length > held:
        spans.append(Span(PADDING, 0, placement.local_length - held, -1))
    return joined_spans(spans)


def chunk_size(length: int, size: int) -> int:
    """The default chunk: ``MOST_CHUNK`` tokens, or fewer so that every rank
    gets at least ``CHUNKS_PER_RANK`` of them."""
    return max(1, min(MOST_CHUNK, length // (CHUNKS_PER_RANK * size)))


@functools.lru_cache(maxsize=64)
def solve(mask: Any, size: int, chunk: Optional[int] = None) -> Assigned:
    """The balanced assignment of ``mask``'s sequence over ``size`` ranks
    (see the module docstring)."""
    length = mask.length
    chunk = chunk or chunk_size(length, size)
    count = -(-length // chunk)
    per_rank = -(-count // size)
    work = np.add.reduceat(mask.row_counts(), np.arange(0, length, chunk)).astype(np.float64)
    contiguous = tuple(tuple(range(r * count // size, (r + 1) * count // size))
                       for r in range(size))
    cuts = [Assigned(length, chunk, chunks, per_rank * chunk)
            for chunks in (contiguous, _scheduled(work, size, per_rank))]
    spread = [_busiest_over_mean(work, cut.chunks) for cut in cuts]
    fair = [i for i, ratio in enumerate(spread) if ratio <= 1 + TOLERANCE]
    if len(fair) > 1:
        best = min(fair, key=lambda i: (_most_received(mask, cuts[i]), i))
    else:
        best = fair[0] if fair else min(range(len(cuts)), key=lambda i: (spread[i], i))
    return cuts[best]


def _scheduled(work: np.ndarray, size: int, per_rank: int) -> Tuple[Tuple[int, ...], ...]:
    """LPT over the chunks' ``work``, neighbours preferred within ``SLACK``."""
    count = len(work)
    slack = SLACK * (float(work.mean()) if count else 0.0)
    load = [0.0] * size
    held: List[List[int]] = [[] for _ in range(size)]
    owner = [-1] * (count + 1)  # owner[-1] (no chunk) is nobody
    open_ranks = list(range(size))
    for c in np.lexsort((np.arange(count), -work)).tolist():
        least = min(load[r] for r in open_ranks)
        near = [r for r in open_ranks if load[r] <= least + slack]
        neighbours = [r for r in near if owner[c - 1] == r or owner[c + 1] == r]
        rank = min(neighbours or near, key=lambda r: (load[r], r))
        owner[c] = rank
        held[rank].append(c)
        load[rank] += float(work[c])
        if len(held[rank]) == per_rank:
            open_ranks.remove(rank)
    return tuple(tuple(sorted(h)) for h in held)


def _busiest_over_mean(work: np.ndarray, chunks: Tuple[Tuple[int, ...], ...]) -> float:
    per_rank = np.array([work[list(held)].sum() for held in chunks])
    mean = per_rank.mean()
    return float(per_rank.max() / mean) if mean > 0 else 1.0


def _most_received(mask: Any, placement: Assigned) -> int:
    """The most keys any rank's queries see that it does not hold."""
    most = 0
    for rank in range(placement.size):
        held = np.array(held_ranges(placement, rank), np.int64).reshape(-1, 2)
        starts, stops = mask.key_ranges(held.tolist())
        inside = covered(starts, stops, held[:, 1]) - covered(starts, stops, held[:, 0])
        most = max(most, int((stops - starts).sum() - inside.sum()))
    return most


def held_ranges(placement: Any, rank: int) -> List[Tuple[int, int]]:
    """The global (start, stop) ranges of ``rank``'s real tokens in
    ``placement`` (any layout's), padding left out."""
    return [(s.origin, s.origin + s.length) for s in placement.spans(rank) if s.doc != PADDING]


def loads(mask: Any, placement: Any) -> np.ndarray:
    """Visible pairs of each rank's queries under ``mask`` in ``placement``
    (any layout's: its spans' real tokens)."""
    return np.array([sum(mask.pairs_in(held) for held in held_ranges(placement, rank))
                     for rank in range(placement.size)], np.float64)


def placement_for(layout: str, size: int, local_length: Optional[int], cu_seqlens: Any = None,
                  mask: Any = None) -> Any:
    """Where every rank's tokens sit: the ``balanced`` solution of ``mask``,
    or the documents' packing in ``layout`` (a mask alone describes one
    sequence of its length). ``local_length`` None: the shards'
    ``shard_sequence`` makes."""
    if mask is not None and cu_seqlens is not None:
        raise ValueError("pass mask= or cu_seqlens=, not both: a mask holds the documents "
                         "(commlib.sequence.masks.from_cu_seqlens)")
    check_layout(layout)
    if mask is not None and local_length is not None:
        _check_mask_length(mask, layout, size, local_length)
    if layout == "balanced" and mask is not None:
        return solve(mask, size)
    offsets = (0, mask.length) if mask is not None else cu_seqlens
    if local_length is None:
        local_length = needed_length(tuple(offsets), layout, size)
    return packing_for(offsets, layout, size, local_length)


def _check_mask_length(mask: Any, layout: str, size: int, local_length: int) -> None:
    """Shards of ``local_length`` must be what ``shard_sequence`` makes of the
    mask's sequence: padding cannot say where a shorter mask ends, so a mask
    of another length would silently hide the rest of the sequence."""
    want = solve(mask, size).local_length if layout == "balanced" else \
        needed_length((0, mask.length), layout, size)
    if local_length != want:
        raise ValueError(f"the mask covers {mask.length} tokens but the shards hold "
                         f"{size * local_length} ({size} of {local_length}; the {layout} "
                         f"layout of a {mask.length}-token sequence gives every rank {want}): "
                         f"make the mask for the global sequence (Mask(slices, length=...)) "
                         f"and its shards with shard_sequence(..., layout='{layout}', "
                         f"mask=mask)")
