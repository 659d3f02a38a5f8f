"""Packed sequences: which document, and which position in it, every token
of every rank's shard holds.

A global sequence is described by ``cu_seqlens`` (flash-attn's convention:
int offsets of the documents packed into it, from 0 to the global length,
the same on every rank; one sequence of length L is ``[0, L]``). The offsets
describe the sequence axis and are shared by every batch row: to pack other
documents in another row, flatten the batch into one row (batch 1), as
flash-attn's varlen functions do.

A layout cuts the sequence among ``size`` ranks:

- ``contiguous``: the sequence, padded at its end to the ranks' total
  length, in ``size`` equal chunks; rank r holds chunk r.
- ``zigzag``: the same in ``2 * size`` chunks; rank r holds chunks r and
  2P-1-r (equal causal work when the sequence is one document).
- ``zigzag_docs``: every document padded to a multiple of 2P and cut into
  2P chunks; rank r holds chunks r and 2P-1-r *of every document* (PyTorch
  context parallelism's per-document head-tail balance: equal causal work
  whatever the document lengths).

Padding tokens belong to no document: nothing attends to them and they
attend to nothing; ``unshard_sequence`` drops them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

__all__ = ["cu_seqlens_from_position_ids"]  # the rest serves the layouts and the attention

LAYOUTS = ("contiguous", "zigzag", "zigzag_docs")
# layouts made from a mask (commlib.sequence.balanced), not from the documents
MASK_LAYOUTS = ("balanced",)
PADDING = -1  # the document of a padding token


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one document held consecutively by a rank:
    ``length`` tokens from ``position`` of document ``doc`` (``PADDING``:
    padding). ``origin`` is the first token's index in the unpadded global
    sequence (-1 for padding)."""

    doc: int
    position: int
    length: int
    origin: int


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS + MASK_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of "
                         f"{', '.join(LAYOUTS + MASK_LAYOUTS)}")


def as_offsets(cu_seqlens: Any, length: Optional[int] = None) -> Tuple[int, ...]:
    """``cu_seqlens`` (a list, NumPy array or host tensor of ints) checked and
    as a tuple; ``length``: the global length it must end at, when known."""
    try:
        offsets = np.asarray(cu_seqlens)
    except Exception as error:  # a traced JAX value, a CUDA tensor
        raise ValueError(f"cu_seqlens must be concrete host integers (a list or NumPy array; "
                         f"static under jax.jit), got {type(cu_seqlens).__name__}: "
                         f"{error}") from None
    if offsets.ndim != 1 or offsets.size < 2 or not np.issubdtype(offsets.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D list of at least two integer offsets "
                         f"(document starts, then the total length), got {offsets.tolist()!r}")
    if offsets[0] != 0 or np.any(np.diff(offsets) <= 0):
        raise ValueError(f"cu_seqlens must start at 0 and increase strictly (every document "
                         f"at least one token), got {offsets.tolist()}")
    if length is not None and offsets[-1] != length:
        raise ValueError(f"cu_seqlens ends at {int(offsets[-1])} but the sequence has {length} "
                         f"tokens; its last offset is the global length")
    return tuple(int(o) for o in offsets)


def chunk_count(size: int, layout: str) -> int:
    """Equal chunks per document (zigzag_docs) or per sequence."""
    return size if layout == "contiguous" else 2 * size


def chunks_of(rank: int, size: int, layout: str) -> Tuple[int, ...]:
    """The chunks rank holds, in the order it holds them."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * size - 1 - rank)


@dataclass(frozen=True)
class Packing:
    """A packed global sequence laid out over ``size`` ranks: every rank's
    spans, and how long every shard is (the same on every rank)."""

    offsets: Tuple[int, ...]
    layout: str
    size: int
    local_length: int

    @property
    def length(self) -> int:
        """Tokens of the unpadded global sequence."""
        return self.offsets[-1]

    def spans(self, rank: int) -> Tuple[Span, ...]:
        return _spans(self, rank)

    def all_spans(self) -> Tuple[Span, ...]:
        """Every rank's spans, rank after rank: what an all-gather of the
        shards holds."""
        return tuple(s for rank in range(self.size) for s in self.spans(rank))

    def in_order(self) -> Tuple[np.ndarray, Tuple[Span, ...]]:
        """(order, spans): ``gathered[order]`` puts an all-gather of the
        shards in sequence order (every document whole, padding last), whose
        spans are ``spans``. Attending to one run per document takes two
        kernel calls per query chunk (the keys before it, the diagonal)
        where rank order takes one per rank."""
        return spans_in_order(self)


@dataclass(frozen=True)
class Grouped:
    """``packing`` as seen by a ring of groups of ``group_size`` consecutive
    ranks: holder g holds the shards of ranks g*group_size ..
    (g+1)*group_size - 1, one after the other (what an all-to-all inside the
    group gathers). An all-gather over the holders holds the same tokens in
    the same order as one over the ranks."""

    packing: Packing
    group_size: int

    @property
    def size(self) -> int:
        return self.packing.size // self.group_size

    @property
    def offsets(self) -> Tuple[int, ...]:
        """The documents: the same sequence, held by groups."""
        return self.packing.offsets

    def spans(self, holder: int) -> Tuple[Span, ...]:
        first = holder * self.group_size
        return joined_spans([s for rank in range(first, first + self.group_size)
                        for s in self.packing.spans(rank)])

    def in_order(self) -> Tuple[np.ndarray, Tuple[Span, ...]]:
        return self.packing.in_order()


def packing_for(cu_seqlens: Any, layout: str, size: int, local_length: int) -> Packing:
    """The packing of shards of ``local_length`` tokens. Without
    ``cu_seqlens`` the shards hold one unpadded sequence; with it, padding
    fills what the documents leave (the layouts' rules above)."""
    check_layout(layout)
    if layout == "balanced":
        raise ValueError("the balanced layout spreads a mask's work: pass mask= (a "
                         "commlib.sequence.masks.Mask) to the call that shards and to the "
                         "attention")
    if cu_seqlens is None:  # one unpadded sequence
        if (local_length * size) % chunk_count(size, layout):
            raise ValueError(f"the {layout} layout cuts the sequence into "
                             f"{chunk_count(size, layout)} equal chunks, so the local sequence "
                             f"length must be even, got {local_length}; pass cu_seqlens (for "
                             f"one sequence of length L: [0, L]) for a padded one")
        return Packing((0, local_length * size), layout, size, local_length)
    offsets = as_offsets(cu_seqlens)
    want = needed_length(offsets, layout, size)
    if layout == "zigzag_docs" and local_length != want:
        raise ValueError(f"with these cu_seqlens the zigzag_docs layout gives every rank "
                         f"{want} tokens (documents padded to multiples of {2 * size}), "
                         f"but the shard has {local_length}; make shards with "
                         f"shard_sequence(..., layout='zigzag_docs', cu_seqlens=...)")
    if layout != "zigzag_docs" and (local_length < want or
                                    (local_length * size) % chunk_count(size, layout)):
        raise ValueError(f"cu_seqlens describe {offsets[-1]} tokens, which need shards of at "
                         f"least {want} tokens in the {layout} layout over {size} ranks, but "
                         f"the shard has {local_length}; make shards with "
                         f"shard_sequence(..., layout='{layout}', cu_seqlens=...)")
    return Packing(offsets, layout, size, local_length)


def needed_length(offsets: Tuple[int, ...], layout: str, size: int) -> int:
    """The shortest shard that holds these documents in this layout."""
    n = chunk_count(size, layout)
    if layout == "zigzag_docs":
        return sum(-(-length // n) * n for length in np.diff(offsets)) // size
    return -(-offsets[-1] // n) * n // size


def _interval(offsets: Tuple[int, ...], start: int, stop: int) -> List[Span]:
    """Spans of the unpadded-then-padded global interval [start, stop)."""
    spans = []
    cut = min(stop, offsets[-1])
    doc = int(np.searchsorted(offsets, start, side="right")) - 1
    while start < cut:
        end = min(cut, offsets[doc + 1])
        spans.append(Span(doc, start - offsets[doc], end - start, start))
        start, doc = end, doc + 1
    if stop > max(start, offsets[-1]):
        spans.append(Span(PADDING, 0, stop - max(start, offsets[-1]), -1))
    return spans


@functools.lru_cache(maxsize=256)
def _spans(packing: Packing, rank: int) -> Tuple[Span, ...]:
    size, layout, offsets = packing.size, packing.layout, packing.offsets
    n = chunk_count(size, layout)
    spans: List[Span] = []
    if layout != "zigzag_docs":
        chunk = packing.local_length * size // n
        for c in chunks_of(rank, size, layout):
            spans += _interval(offsets, c * chunk, (c + 1) * chunk)
        return joined_spans(spans)
    for doc, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
        chunk = -(-(stop - start) // n)
        for c in chunks_of(rank, size, layout):
            real = max(0, min(chunk, stop - start - c * chunk))
            if real:
                spans.append(Span(doc, c * chunk, real, start + c * chunk))
            if chunk - real:
                spans.append(Span(PADDING, 0, chunk - real, -1))
    return joined_spans(spans)


def joined_spans(spans: List[Span]) -> Tuple[Span, ...]:
    """Adjacent spans that continue each other merged (padding with padding)."""
    joined: List[Span] = []
    for span in spans:
        last = joined[-1] if joined else None
        if last is not None and last.doc == span.doc and (
                span.doc == PADDING or last.position + last.length == span.position):
            joined[-1] = Span(last.doc, last.position, last.length + span.length, last.origin)
        else:
            joined.append(span)
    return tuple(joined)


@functools.lru_cache(maxsize=64)
def spans_in_order(packing: Packing) -> Tuple[np.ndarray, Tuple[Span, ...]]:
    index = np.concatenate([local_index(packing, rank) for rank in range(packing.size)])
    real = np.flatnonzero(index >= 0)
    order = np.concatenate([real[np.argsort(index[real], kind="stable")],
                            np.flatnonzero(index < 0)])
    return order, joined_spans(_interval(packing.offsets, 0, index.size))


def local_index(packing: Packing, rank: int) -> np.ndarray:
    """For each token of rank's shard, its index in the unpadded global
    sequence, or -1 for padding."""
    parts = [np.full(s.length, -1) if s.doc == PADDING else
             np.arange(s.origin, s.origin + s.length) for s in packing.spans(rank)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def positions_of(packing: Packing, rank: int) -> np.ndarray:
    """For each token of rank's shard, its position in its document (0 for
    padding): the RoPE positions of the shard."""
    parts = [np.zeros(s.length, np.int64) if s.doc == PADDING else
             np.arange(s.position, s.position + s.length) for s in packing.spans(rank)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def cu_seqlens_from_position_ids(position_ids: Any) -> np.ndarray:
    """``cu_seqlens`` of a packed sequence whose ``position_ids`` (global,
    unsharded: [seq] or [1, seq]) restart at 0 at every document, as
    transformers' data collators make them."""
    positions = np.asarray(position_ids.detach().cpu() if hasattr(position_ids, "detach")
                           else position_ids)
    if positions.ndim == 2 and (positions == positions[:1]).all():
        positions = positions[0]  # every row packed alike
    if positions.ndim != 1 or positions.size == 0:
        raise ValueError(f"position_ids must be [seq] or [batch, seq] with every row packed "
                         f"alike, got shape {positions.shape}; flatten differently packed rows "
                         f"into one row")
    starts = np.flatnonzero(positions == 0)
    if starts.size == 0 or starts[0] != 0:
        raise ValueError("packed position_ids must start at 0 and restart at 0 at every "
                         "document")
    return np.append(starts, positions.size).astype(np.int32)
