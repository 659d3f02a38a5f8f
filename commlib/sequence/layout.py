"""How a global sequence is cut among the ranks of a ring, and put back.

The layouts (``contiguous``, ``zigzag``, ``zigzag_docs``) and the padding
rules are ``commlib.sequence.documents``'s: a sequence of any length is padded to
what its layout needs, and ``unshard_sequence`` gives back exactly the
original tokens.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ..namespace import contiguous, device, namespace
from .balanced import placement_for
from .documents import (
    LAYOUTS,
    MASK_LAYOUTS,
    PADDING,
    as_offsets,
    check_layout,
    chunk_count,
    chunks_of,
)
from .masks import check_mask

__all__ = ["LAYOUTS", "MASK_LAYOUTS", "check_layout", "chunks_of", "shard_sequence",
           "unshard_sequence"]


def _along(x: Any, axis: int, start: int, stop: int) -> Any:
    return x[(slice(None),) * (axis % len(x.shape)) + (slice(start, stop),)]


def _padding(x: Any, axis: int, length: int) -> Any:
    xp = namespace(x)
    shape = list(x.shape)
    shape[axis] = length
    return xp.zeros(tuple(shape), dtype=x.dtype, device=device(x))


def shard_sequence(x: Any, comm, *, layout: str, axis: int = 1,
                   cu_seqlens: Any = None, mask: Any = None) -> Any:
    """This rank's shard of the global ``x`` (the same on every rank), in the
    caller's framework. ``layout`` has no default: the attention that reads
    the shards takes the same ``layout=``, and a shard in one layout read as
    another would be attention over the wrong tokens. Any length: the shard
    is padded (with zeros) where the layout needs it; pass the same
    ``cu_seqlens`` (or ``mask``) to the attention (for one sequence of
    uneven length L: ``cu_seqlens=[0, L]``). ``zigzag_docs`` balances every
    document: give it the documents' ``cu_seqlens`` (without them the
    sequence is one document). ``balanced`` spreads the work of ``mask``
    (``commlib.sequence.masks.Mask``, of x's length) evenly (``commlib.sequence.balanced``)."""
    placement = shard_placement(comm, layout, x.shape[axis], cu_seqlens, mask, None)
    xp = namespace(x)
    pieces = [_padding(x, axis, s.length) if s.doc == PADDING else
              _along(x, axis, s.origin, s.origin + s.length)
              for s in placement.spans(comm.rank)]
    return contiguous(xp.concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0])


def unshard_sequence(x: Any, comm, *, layout: str, axis: int = 1,
                     cu_seqlens: Any = None, length: Optional[int] = None,
                     mask: Any = None) -> Any:
    """The global sequence from every rank's shard (collective: an
    allgather), padding removed: ``length`` (or ``cu_seqlens``'s end, or
    ``mask``'s length) tokens, in the caller's framework."""
    xp = namespace(x)
    local = x.shape[axis]
    if length is None and mask is not None:
        length = mask.length
    placement = shard_placement(comm, layout, length, cu_seqlens, mask, local)
    gathered = comm.allgather(x, axis=axis)
    placed: List[tuple] = []
    at = 0
    for span in placement.all_spans():
        if span.doc != PADDING:
            placed.append((span.origin, at, span.length))
        at += span.length
    pieces = [_along(gathered, axis, start, start + n) for _, start, n in sorted(placed)]
    return xp.concat(pieces, axis=axis) if len(pieces) > 1 else pieces[0]


def shard_placement(comm, layout: str, length: Optional[int], cu_seqlens: Any, mask: Any,
               local: Optional[int]) -> Any:
    """Where every rank's tokens sit, for shards of ``local`` tokens (None:
    the length the layout gives) of a sequence of ``length`` tokens (None:
    all the shards hold)."""
    check_layout(layout)
    if mask is not None:
        check_mask(mask, length)
        return placement_for(layout, comm.size, local, mask=mask)
    if cu_seqlens is None and local is None and layout not in ("zigzag_docs",) + MASK_LAYOUTS:
        n = chunk_count(comm.size, layout)
        if length % n:
            raise ValueError(f"a sequence of length {length} cannot be cut into {n} equal "
                             f"chunks ({layout} layout over {comm.size} ranks): pass "
                             f"cu_seqlens=[0, {length}] to pad it (and the same to the "
                             f"attention), or pad it to a multiple of {n}")
    if cu_seqlens is None:
        offsets = (0, local * comm.size if length is None else length)
    else:
        offsets = as_offsets(cu_seqlens, length)
    return placement_for(layout, comm.size, local, cu_seqlens=offsets)
