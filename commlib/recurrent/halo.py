"""The tokens before each piece: what a causal convolution of kernel
``width + 1`` reads across a shard's edges.

Every rank sends the last ``width`` tokens of each of its real pieces (one
all-gather, O(pieces x width) tokens, independent of the sequence length).
A piece's halo is the ``width`` global positions before it: each position
lies in the tail of the piece that holds it (pieces in between are shorter
than ``width`` and wholly inside the window), so a halo is a few slices of
the gathered tails, walking back over as many pieces as it takes. Positions
before the piece's document (with ``cu_seqlens``; before the sequence
without) are zeros, as a convolution that restarts at each document sees
them; a padding piece's halo is zeros.

Backward: each rank sums its halos' gradients into the tails they read and
sends every owner its tails' sums (one all-to-all, as many bytes as the
forward's gather); the owner adds them up and places them at the tails'
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import array_api_extra as xpx
import numpy as np

from ..namespace import device, dtype_name, namespace
from .pieces import Piece, Sharding, agreed_sharding

__all__ = ["halo", "halo_backward"]


@dataclass(frozen=True)
class Segment:
    """``length`` consecutive halo tokens: zeros (``tail`` None) or the tail
    of real piece ``tail = (rank, index among its real pieces)`` from slot
    ``slot``."""

    length: int
    tail: Optional[Tuple[int, int]] = None
    slot: int = 0


def _segments(sharding: Sharding, rank: int, width: int) -> List[List[Segment]]:
    """Each of ``rank``'s pieces' halo as segments, in order."""
    order = sharding.order
    origins = np.array([sharding.piece(*key).origin for key in order])
    found = []
    for piece in sharding.per_rank[rank]:
        if piece.is_padding:
            found.append([Segment(width)])
            continue
        first = max(piece.origin - width, piece.document_start)
        parts = [Segment(first - (piece.origin - width))] if first > piece.origin - width else []
        at = first
        while at < piece.origin:
            key = order[int(np.searchsorted(origins, at, side="right")) - 1]
            held = sharding.piece(*key)
            end = held.origin + held.length
            stop = min(end, piece.origin)
            parts.append(Segment(stop - at, key, at - (end - width)))
            at = stop
        found.append(parts)
    return found


def _zeros(like: Any, rows: int, rest: Tuple[int, ...]) -> Any:
    return namespace(like).zeros((rows,) + rest, dtype=like.dtype, device=device(like))


def _checked(comm, op: str, shape: Tuple[int, ...], width: int, axis: int, layout: str,
             cu_seqlens: Any, mask: Any, dtype: str,
             grad_shape: Optional[Tuple[int, ...]] = None) -> Tuple[Sharding, int]:
    """The sharding of a shard of ``shape``, and ``axis`` made non-negative;
    ``grad_shape`` (backward): the halos' gradient, checked against it."""
    normalized: List[int] = []

    def check(held: Tuple[Piece, ...]) -> tuple:
        if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 1:
            raise ValueError(f"width must be a positive int (a causal convolution of kernel "
                             f"k reads k - 1 tokens before each), got {width!r}")
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"axis {axis} is out of range for x of shape {shape}")
        normalized.append(axis % len(shape))
        rest = shape[:normalized[0]] + shape[normalized[0] + 1:]
        want = (len(held),) + shape[:normalized[0]] + (width,) + shape[normalized[0] + 1:]
        if grad_shape is not None and grad_shape != want:
            raise ValueError(f"grad_halo must have halo's shape {want}, got {grad_shape}")
        return int(width), normalized[0], rest, dtype
    local = shape[axis] if -len(shape) <= axis < len(shape) else None
    sharding = agreed_sharding(comm, op, local, check, layout=layout, cu_seqlens=cu_seqlens,
                               mask=mask)
    return sharding, normalized[0]


def halo(x: Any, width: int, comm, *, layout: str, axis: int = 1, cu_seqlens: Any = None,
         mask: Any = None) -> Any:
    """For each of this rank's pieces (``commlib.recurrent.pieces``), the
    ``width`` tokens before it in the global sequence, stacked on a new
    axis 0: [pieces, *x.shape with ``width`` along ``axis``]. Zeros before
    the piece's document (or the sequence), and for a padding piece. x: this
    rank's shard (``shard_sequence``'s, sequence along ``axis``). Collective;
    in x's framework and dtype."""
    shape = tuple(x.shape)
    sharding, axis = _checked(comm, "recurrent.halo", shape, width, axis, layout, cu_seqlens,
                              mask, dtype_name(x))
    xp = namespace(x)
    rows = xp.moveaxis(x, axis, 0)
    rest = tuple(rows.shape[1:])
    tails = []
    for piece in sharding.real[comm.rank]:
        kept = min(width, piece.length)
        tails += [_zeros(x, width - kept, rest), rows[piece.stop - kept:piece.stop]]
    blank = sharding.most_real - len(sharding.real[comm.rank])
    gathered = comm.allgather(xp.concat(tails + [_zeros(x, blank * width, rest)]), axis=0)

    def tail_rows(segment: Segment) -> Any:
        if segment.tail is None:
            return _zeros(x, segment.length, rest)
        rank, i = segment.tail
        first = (rank * sharding.most_real + i) * width + segment.slot
        return gathered[first:first + segment.length]
    halos = [xp.concat([tail_rows(s) for s in parts])
             for parts in _segments(sharding, comm.rank, width)]
    return xp.moveaxis(xp.stack(halos), 1, axis + 1)


def halo_backward(grad_halo: Any, x_shape_or_like: Any, width: int, comm, *, layout: str,
                  axis: int = 1, cu_seqlens: Any = None, mask: Any = None) -> Any:
    """The gradient of ``halo`` with respect to the shard x (of shape
    ``x_shape_or_like``, or like that array) given ``grad_halo`` (halo's
    shape): every rank's halo gradients summed into the tokens they read,
    zero elsewhere. Collective; in grad_halo's framework and dtype."""
    shape = tuple(getattr(x_shape_or_like, "shape", x_shape_or_like))
    sharding, axis = _checked(comm, "recurrent.halo_backward", shape, width, axis, layout,
                              cu_seqlens, mask, dtype_name(grad_halo), tuple(grad_halo.shape))
    xp = namespace(grad_halo)
    halo_rows = xp.moveaxis(grad_halo, axis + 1, 1)
    rest = tuple(halo_rows.shape[2:])
    read: dict = {}  # tail -> its gradient, summed over this rank's halos
    for p, parts in enumerate(_segments(sharding, comm.rank, width)):
        at = 0
        for segment in parts:
            if segment.tail is not None:
                part = halo_rows[p, at:at + segment.length]
                padded = xp.concat([_zeros(grad_halo, segment.slot, rest), part,
                                    _zeros(grad_halo, width - segment.slot - segment.length,
                                           rest)])
                earlier = read.get(segment.tail)
                read[segment.tail] = padded if earlier is None else earlier + padded
            at += segment.length
    blank = _zeros(grad_halo, width, rest)
    sent = xp.concat([read.get((rank, i), blank) for rank in range(comm.size)
                      for i in range(sharding.most_real)])
    received = comm.alltoall(sent, split_axis=0, concat_axis=0)
    summed = xp.sum(xp.reshape(received, (comm.size, sharding.most_real * width) + rest), axis=0)
    grad_x = xp.zeros(shape, dtype=grad_halo.dtype, device=device(grad_halo))
    for real, piece in enumerate(sharding.real[comm.rank]):
        kept = min(width, piece.length)
        along = (slice(None),) * axis + (slice(piece.stop - kept, piece.stop),)
        tail = summed[(real + 1) * width - kept:(real + 1) * width]
        grad_x = xpx.at(grad_x)[along].set(xp.moveaxis(tail, 0, axis))
    return grad_x
