"""What a sharded mixer runs on each of its shard's pieces: where the piece
sits in the shard, the document starts inside it (where its recurrence
resets), and whether it holds the sequence's first or last token.

Framework-free (host integers only), shared by the torch and JAX mixers:
the checks of a mixer call and the piece layout are agreed by every rank
before anything is computed, so bad input raises on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

import numpy as np

from ..sequence.documents import LAYOUTS, as_offsets
from .pieces import agreed_sharding

__all__ = ["Run", "runs"]


@dataclass(frozen=True)
class Run:
    """One of the shard's pieces: where it sits and what it holds."""

    start: int
    stop: int
    resets: Tuple[int, ...]  # document starts inside it, from its start
    begins: bool             # holds the sequence's first token
    ends: bool               # holds the sequence's last real token
    padding: bool = False    # shard_sequence's padding: computed and read by nobody


def runs(comm, op: str, local_length: int, layout: str, cu_seqlens: Any,
         check: Callable[[], Tuple], carried: bool) -> List[Run]:
    """The shard's pieces, its inputs checked (``check`` raises ValueError
    or returns the facts every rank must share) and agreed by every rank:
    bad input raises on every rank. With an initial state (``carried``) the
    sequence's first token is no reset. Padding pieces are computed and
    read by nobody (``commlib.recurrent.pieces``)."""
    if layout not in LAYOUTS:
        comm.agree(op, problem=ValueError(f"the recurrent mixers read the "
                                          f"{', '.join(LAYOUTS)} layouts, not {layout!r}"))
    found = agreed_sharding(comm, op, local_length, lambda _held: check(), layout=layout,
                            cu_seqlens=cu_seqlens, mask=None)
    end = max(p.origin + p.length for held in found.real for p in held)
    offsets = (0, end) if cu_seqlens is None else as_offsets(cu_seqlens)
    starts = np.asarray([s for s in offsets[:-1] if s or not carried])
    found_runs = []
    for p in found.per_rank[comm.rank]:
        inside = starts[(starts >= p.origin) & (starts < p.origin + p.length)] - p.origin
        found_runs.append(Run(p.start, p.stop,
                              tuple(int(i) for i in inside) if not p.is_padding else (),
                              p.origin == 0, not p.is_padding and p.origin + p.length == end,
                              p.is_padding))
    return found_runs

