"""How a global sequence is cut among the ranks of a ring.

``contiguous``: rank r holds the r-th of P equal chunks. ``zigzag``: the
sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so that
under a causal mask every rank has the same amount of work (an early chunk,
cheap, paired with a late one, expensive).
"""

from __future__ import annotations

from typing import Any, List, Tuple

from ..namespace import contiguous, namespace

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")


def chunks_of(rank: int, size: int, layout: str) -> Tuple[int, ...]:
    """Indices of the chunks rank holds, in the order it holds them, out of
    ``size`` (contiguous) or ``2 * size`` (zigzag) chunks."""
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * size - 1 - rank)


def _chunk_count(size: int, layout: str) -> int:
    return size if layout == "contiguous" else 2 * size


def _pieces(x: Any, count: int, axis: int) -> List[Any]:
    """``x`` cut into ``count`` equal views along ``axis``."""
    length = x.shape[axis] // count
    before = (slice(None),) * (axis % len(x.shape))
    return [x[before + (slice(i * length, (i + 1) * length),)] for i in range(count)]


def shard_sequence(x: Any, comm, layout: str = "zigzag", axis: int = 1) -> Any:
    """This rank's shard of the global ``x`` (the same on every rank), in the
    caller's framework. The length along ``axis`` must divide into
    ``size`` (contiguous) or ``2 * size`` (zigzag) equal chunks."""
    check_layout(layout)
    xp = namespace(x)
    n = _chunk_count(comm.size, layout)
    length = x.shape[axis]
    if length % n:
        raise ValueError(f"a sequence of length {length} cannot be cut into {n} equal chunks "
                         f"({layout} layout over {comm.size} ranks); pad it to a multiple of {n}")
    pieces = _pieces(x, n, axis)
    mine = [pieces[c] for c in chunks_of(comm.rank, comm.size, layout)]
    return contiguous(xp.concat(mine, axis=axis) if len(mine) > 1 else mine[0])


def unshard_sequence(x: Any, comm, layout: str = "zigzag", axis: int = 1) -> Any:
    """The global sequence from every rank's shard (collective: an allgather),
    in the caller's framework."""
    check_layout(layout)
    xp = namespace(x)
    gathered = comm.allgather(x, axis=axis)
    per_rank = len(chunks_of(0, comm.size, layout))
    pieces = _pieces(gathered, comm.size * per_rank, axis)
    order: List[Any] = [None] * len(pieces)
    for rank in range(comm.size):
        for slot, chunk in enumerate(chunks_of(rank, comm.size, layout)):
            order[chunk] = pieces[rank * per_rank + slot]
    return xp.concat(order, axis=axis)
