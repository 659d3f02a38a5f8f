"""The owner's side of a dispatch: the arrivals, chunk by chunk as they
land, expanded into one row per (arrival, local expert) of expert_x; and
combine's per-arrival sums of those rows, chunk by chunk, so that a
pipelined route (``commlib.moe.pipeline``) can send each chunk back while
the owner sums the next.

Counted dispatch (``Expansion``): each chunk's rows are written into
expert_x as the chunk lands, while the next one still crosses. expert_x
holds each local expert's rows together, experts in order; inside an
expert the rows come chunk after chunk, each chunk's in arrival order.
Where an expert's next row goes is a cursor on the device (the expert's
first row, from the counts every rank learned, plus the rows placed so
far), so placing reads nothing back; how many (arrival, expert) pairs a
chunk holds comes from the count exchange. A route of one chunk (flat, or
two hops unpipelined) skips all that: its pairs sorted by expert are
expert_x's rows in order, so expert_x is one gather of the arrivals and
combine sums the expert rows in place (the scatter and combine's gather of
every expert row cost the torch pair 1.6x; issue 37).

A fixed capacity has static sizes and no count exchange, so a chunk's pair
count is unknown until the device is read: its expert_x is made once every
chunk is in (one gather over the slots, ``FixedPath._expand``), and
its combine gathers each arrival's k slots chunk by chunk
(``GatheredRows``), or scatters every expert row at once where that
touches fewer rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import array_api_extra as xpx
import numpy as np

from ..namespace import (
    bincount,
    device,
    float32,
    framework,
    from_host_ints,
    index_dtype,
    namespace,
    sum_rows,
    take_rows,
    zeroed_rows,
)


@dataclass
class ScatteredRows:
    """Arrivals whose sums scatter their expert rows: pair i adds expert row
    ``expert_rows[i]`` (all rows in order where None) onto arrival
    ``arrival[i]``; an arrival index equal to ``arrivals`` is padding,
    summed onto a spare row and cut off."""

    arrivals: int
    expert_rows: Optional[Any]  # [pairs] (None: pair i is expert row i)
    arrival: Any                # [pairs] its arrival, from this record's first
    slot: Any                   # [pairs] which of the token's k slots
    weight: Any                 # [pairs] float32 routing weight
    first: int = 0              # the record's first arrival among the owner's

    def sums(self, rows: Any, weighted: bool) -> Any:
        """Each arrival's sum of its expert rows (weighted), float32."""
        return sum_rows(rows, self.arrival, self.arrivals + 1, rows=self.expert_rows,
                        scale=self.weight if weighted else None,
                        dtype=namespace(rows).float32)[:self.arrivals]


@dataclass
class GatheredRows:
    """Fixed capacity: arrivals whose sums gather their k slots' expert
    rows, work in arrivals * k, not in the padded expert rows, which are
    never read (a masked expert may leave them uninitialized, NaN
    included)."""

    arrivals: int
    slot_rows: Any     # [arrivals * k] expert row of each (arrival, slot); none: >= rows
    slot_weights: Any  # [arrivals * k] float32, 0 where none
    k: int

    def sums(self, rows: Any, weighted: bool) -> Any:
        """Torch on the CPU: ``_SLICE_BYTES`` of float32 terms at a time into
        one output (three fresh temporaries the size of every term cost
        their page faults: 64 decode tokens x 8 slots x 7168 channels is 29
        MB each; issue 37). Each arrival's sum is the same either way."""
        trailing = tuple(rows.shape[1:])
        if framework(rows) != "torch" or rows.device.type != "cpu":
            return self._sums(rows, weighted, 0, self.arrivals)
        step = max(1, _SLICE_BYTES // max(1, 4 * self.k * math.prod(trailing)))
        if step >= self.arrivals:
            return self._sums(rows, weighted, 0, self.arrivals)
        import torch
        out = torch.empty((self.arrivals,) + trailing, dtype=torch.float32, device=rows.device)
        for low in range(0, self.arrivals, step):
            high = min(low + step, self.arrivals)
            out[low:high] = self._sums(rows, weighted, low, high)
        return out

    def _sums(self, rows: Any, weighted: bool, low: int, high: int) -> Any:
        """Arrivals low..high-1's sums: the picked rows, the empty slots'
        zeroed (a padded row may hold NaN, and NaN times a zero weight is
        NaN), then one (1 x k) @ (k x hidden) product per arrival in float32,
        not separate passes that scale, mask and sum (issue 37)."""
        xp = namespace(rows)
        trailing = tuple(rows.shape[1:])
        slot_rows = self.slot_rows[low * self.k:high * self.k]
        valid = slot_rows < rows.shape[0]
        picked = zeroed_rows(take_rows(rows, xp.where(valid, slot_rows, 0)), valid)
        factor = self.slot_weights[low * self.k:high * self.k] if weighted \
            else xp.astype(valid, xp.float32)
        terms = xp.reshape(float32(picked), (high - low, self.k, math.prod(trailing)))
        sums = xp.matmul(xp.reshape(factor, (high - low, 1, self.k)), terms)
        return xp.reshape(sums, (high - low,) + trailing)


# bytes of float32 terms GatheredRows sums at a time in torch on the CPU
_SLICE_BYTES = 2 << 20


class Expansion:
    """A counted dispatch's expert_x, filled chunk by chunk as the chunks
    land (``add``). ``per_expert``: host rows of each local expert, all
    chunks together; ``first_expert``: this rank's first expert id;
    ``decode``: a chunk's payload bytes to its parts (x's rows, or FP8
    values and scales); ``like``: an array beside which to allocate."""

    def __init__(self, per_expert: np.ndarray, first_expert: int,
                 decode: Callable[[Any], Tuple[Any, ...]], like: Any, chunks: int):
        # one chunk (flat, or two hops unpipelined): its pairs sorted by expert are
        # expert_x's rows in order, so no cursor, no scatter, and combine gathers nothing
        self._whole = chunks == 1
        self._cursor = None if self._whole else from_host_ints(np.cumsum(per_expert)
                                                               - per_expert, like)
        self._total = int(per_expert.sum())
        self._local = len(per_expert)
        self._first_expert = first_expert
        self._decode = decode
        self.parts: Optional[List[Any]] = None  # expert_x's parts
        self.chunks: List[ScatteredRows] = []
        self.arrivals = 0

    def add(self, ids: Any, gate: Any, payload: Any, pairs: int) -> None:
        """One chunk's arrivals: ``ids`` [n, k] the expert ids this rank
        serves (-1: another's), ``gate`` [n, k] float32 their weights,
        ``payload`` [n, bytes] the rows; ``pairs`` the served ids (host)."""
        xp = namespace(ids)
        kind, where = ids.dtype, device(ids)
        arrivals, k = ids.shape
        local = xp.reshape(xp.where(ids >= 0, ids - self._first_expert, self._local), (-1,))
        order = xp.argsort(local, stable=True)[:pairs]  # served pairs, by expert, as they came
        arrival = order // max(k, 1)
        parts = self._decode(payload)
        if self._whole:  # expert_x's rows are these pairs, in order
            target = None
            self.parts = [take_rows(part, arrival) for part in parts]
        else:
            expert = xp.take(local, order)
            within = xp.arange(pairs, dtype=kind, device=where) - xp.searchsorted(expert, expert)
            target = xp.take(self._cursor, expert) + within
            self._cursor = self._cursor + bincount(expert, self._local)
            if self.parts is None:
                self.parts = [xp.empty((self._total,) + tuple(p.shape[1:]), dtype=p.dtype,
                                       device=device(p)) for p in parts]
            self.parts = [xpx.at(whole)[target].set(take_rows(part, arrival))
                          for whole, part in zip(self.parts, parts)]
        self.chunks.append(ScatteredRows(arrivals, target, arrival, order % max(k, 1),
                                         xp.take(xp.reshape(gate, (-1,)), order),
                                         first=self.arrivals))
        self.arrivals += arrivals

    def by_expert_row(self) -> Tuple[Any, Any, Any]:
        """For each expert row: its arrival among all of the owner's, its
        slot and its weight (the gradients' view of the expansion)."""
        if self._whole:
            chunk = self.chunks[0]
            return chunk.arrival, chunk.slot, chunk.weight
        like = self.chunks[0].arrival
        xp, where = namespace(like), device(like)
        arrival = xp.zeros(self._total, dtype=index_dtype(like), device=where)
        slot = xp.zeros(self._total, dtype=index_dtype(like), device=where)
        weight = xp.zeros(self._total, dtype=xp.float32, device=where)
        for chunk in self.chunks:
            arrival = xpx.at(arrival)[chunk.expert_rows].set(chunk.first + chunk.arrival)
            slot = xpx.at(slot)[chunk.expert_rows].set(chunk.slot)
            weight = xpx.at(weight)[chunk.expert_rows].set(chunk.weight)
        return arrival, slot, weight
