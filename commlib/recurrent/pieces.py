"""Where a shard's recurrences start: its pieces, the stretches of the global
sequence it holds.

A recurrent mixer carries a state along the global sequence. A shard made by
``commlib.ring.shard_sequence`` holds one run of it (``contiguous``), two
(``zigzag``: chunks r and 2P-1-r), or more (``zigzag_docs``, ``balanced``);
each run needs the state that enters it and the tokens just before it.

A piece is a maximal run of shard tokens at consecutive global positions,
and nothing else: documents do not cut pieces (a reset inside a piece is
the mixer's, in its own chunked algorithm), so zigzag's middle rank, whose
chunks P-1 and P follow each other, has ONE piece.

Padding is a piece of its own. The tokens ``shard_sequence`` pads with
carry no state: a padding piece gets a zero state and a zero halo, and its
``(transition, offset)`` are read by nobody (their gradients are zero).
Padding therefore never sits inside or at the end of a real piece, so a
real piece's outgoing state is the state after its last real token, however
the mixer treats padding tokens (decays still apply to zero inputs).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import numpy as np

from ..sequence.documents import PADDING, chunk_count
from ..sequence.layout import shard_placement

__all__ = ["Piece", "Sharding", "sharding", "pieces", "agreed_sharding"]


@dataclass(frozen=True)
class Piece:
    """Shard tokens ``[start, stop)``. Real pieces: the first one sits at
    global position ``origin``, in a document that starts at global position
    ``document_start`` (``origin`` itself: the piece starts the document, or
    the sequence, and enters with a zero state). Padding: ``origin`` -1."""

    start: int
    stop: int
    origin: int
    document_start: int

    @property
    def is_padding(self) -> bool:
        return self.origin < 0

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def starts_document(self) -> bool:
        return self.origin == self.document_start


@dataclass(frozen=True)
class Sharding:
    """Every rank's pieces (every rank computes all of them, alike, from the
    placement alone) and the real ones in global order."""

    per_rank: Tuple[Tuple[Piece, ...], ...]

    @functools.cached_property
    def real(self) -> Tuple[Tuple[Piece, ...], ...]:
        """Each rank's real pieces, in shard order: what it sends."""
        return tuple(tuple(p for p in held if not p.is_padding) for held in self.per_rank)

    @functools.cached_property
    def most_real(self) -> int:
        """The most real pieces one rank holds: every rank's message is padded to it."""
        return max(len(held) for held in self.real)

    @functools.cached_property
    def order(self) -> Tuple[Tuple[int, int], ...]:
        """(rank, index among its real pieces) of every real piece, in global order."""
        keyed = [(p.origin, rank, i) for rank, held in enumerate(self.real)
                 for i, p in enumerate(held)]
        return tuple((rank, i) for _, rank, i in sorted(keyed))

    def piece(self, rank: int, i: int) -> Piece:
        return self.real[rank][i]


def _maximal_pieces(spans: Tuple[Any, ...]) -> Tuple[Piece, ...]:
    """Spans (``commlib.sequence.documents.Span``, in shard order) joined into pieces."""
    found = []
    at = 0
    for span in spans:
        last = found[-1] if found else None
        if span.doc == PADDING:
            found.append(Piece(at, at + span.length, -1, -1))
        elif last is not None and not last.is_padding and \
                last.origin + last.length == span.origin:
            found[-1] = Piece(last.start, at + span.length, last.origin, last.document_start)
        else:
            found.append(Piece(at, at + span.length, span.origin, span.origin - span.position))
        at += span.length
    return tuple(found)


def sharding(comm, local_length: Optional[int], *, layout: str, cu_seqlens: Any = None,
             mask: Any = None) -> Sharding:
    """The pieces of shards of ``local_length`` tokens made by
    ``shard_sequence(..., layout=, cu_seqlens=, mask=)``. ``local_length``
    None: the length ``shard_sequence`` makes (without ``cu_seqlens`` or
    ``mask`` any length cuts the same way, so a nominal one is used)."""
    if local_length is None and cu_seqlens is None and mask is None:
        local_length = chunk_count(comm.size, layout) // comm.size
    placement = shard_placement(comm, layout, None, cu_seqlens, mask, local_length)
    return Sharding(tuple(_maximal_pieces(placement.spans(rank)) for rank in range(comm.size)))


def pieces(comm, local_length: int, *, layout: str, cu_seqlens: Any = None,
           mask: Any = None) -> Tuple[Tuple[int, int], ...]:
    """The pieces of this rank's shard of ``local_length`` tokens (made by
    ``shard_sequence`` with the same ``layout``, ``cu_seqlens``, ``mask``),
    as (start, stop) positions in the shard, in shard order: contiguous one
    (two on the rank whose shard ends in padding), zigzag two (one on the
    middle rank P-1, whose chunks follow each other), padding always a piece
    of its own (see the module docstring). Local: no communication."""
    if not isinstance(local_length, (int, np.integer)) or local_length < 1:
        raise ValueError(f"local_length must be a positive int (the shard's length), "
                         f"got {local_length!r}")
    held = sharding(comm, int(local_length), layout=layout, cu_seqlens=cu_seqlens,
                    mask=mask).per_rank[comm.rank]
    return tuple((p.start, p.stop) for p in held)


def agreed_sharding(comm, op: str, local_length: Optional[int],
                    check: Callable[[Tuple[Piece, ...]], tuple], *, layout: str,
                    cu_seqlens: Any, mask: Any) -> Sharding:
    """This call's pieces, with its inputs checked on this rank and agreed
    by every rank: ``check(this rank's pieces)`` raises ValueError or
    returns the facts every rank must share (shapes beyond the piece axis,
    dtype, settings). Any rank's problem, or ranks that disagree, raise on
    every rank before anything moves."""
    problem = found = None
    facts: tuple = ()
    try:
        found = sharding(comm, local_length, layout=layout, cu_seqlens=cu_seqlens, mask=mask)
        facts = check(found.per_rank[comm.rank]) + (
            layout, zlib.crc32(repr(found.per_rank).encode()))
    except (ValueError, TypeError) as error:  # TypeError: arrays of mixed frameworks
        problem = error
    comm.agree(op, *facts, problem=problem)
    return found
