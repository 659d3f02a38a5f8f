"""Which tokens of the global sequence an attention call reads, as a commlib mask.

commlib sees the ranks' shards one after the other: [rank 0's local
sequence | rank 1's | ...], each ``local`` tokens long. A local sequence is
a run of segments (Flux's joint attention: [text | image]), each either a
shard of a split stream (its real tokens first, then padding) or a stream
kept whole on every rank. Attention here is full (non-causal), so the order
of the keys does not matter, only that every real key counts once:

- a query is real unless it is padding (the copies of a whole stream on
  every rank are real queries: each rank needs their answers);
- a key is real unless it is padding, or a copy of a whole stream on a rank
  other than 0 (one copy counts, else each would weigh ``size`` times), or
  hidden by the model's own key mask (QwenImage's text padding).

The mask is every (real query run) x (real key run) as ``full`` slices;
none at all where every token is real.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from commlib.sequence.masks import Mask, Slice

from ._shards import Split


@dataclass(frozen=True)
class Segment:
    """A stretch of the local sequence: a shard of ``split``, or, ``split``
    None, ``length`` tokens that every rank holds whole."""

    length: int
    split: Optional[Split] = None


def _valid(segments: Sequence[Segment], size: int, keys: bool) -> np.ndarray:
    rows = []
    for rank in range(size):
        for segment in segments:
            row = np.zeros(segment.length, dtype=bool)
            if segment.split is not None:
                row[:segment.split.counts[rank]] = True
            elif not keys or rank == 0:
                row[:] = True
            rows.append(row)
    return np.concatenate(rows)


def runs(valid: np.ndarray) -> List[Tuple[int, int]]:
    """The [start, stop) runs of True in ``valid``."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], valid.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def visibility(segments: Sequence[Segment], size: int,
               key_mask: Optional[np.ndarray] = None) -> Optional[Mask]:
    """The mask of a full attention over ``segments`` on every rank;
    ``key_mask``: the model's own mask of visible keys over the global
    sequence (bool), or None. None where every token is real."""
    queries = _valid(segments, size, keys=False)
    keys = _valid(segments, size, keys=True)
    if key_mask is not None:
        keys &= key_mask
    if queries.all() and keys.all():
        return None
    key_runs = runs(keys)
    if not key_runs:
        raise ValueError("attention with every key hidden (the model's key mask hides every "
                         "real token)")
    return Mask([Slice(q, k) for q in runs(queries) for k in key_runs], length=len(queries))
