"""Zero-redundant K/V movement (MagiAttention's group-cast and
group-reduce): each rank receives only the keys and values that some of its
queries see, and sends dK/dV partials only to the ranks that own them,
instead of passing every block around the ring.

The routes come from the mask alone (the call's ``visibility()``: the
given mask, or packed documents, causality and a window made into one):
for every rank, the
global keys any of its queries sees; for every pair of ranks, the rows of
the sender's shard the receiver needs. Every rank computes all of them on
the host, the same everywhere, cached per mask and placement.

Forward: one variable-size all-to-all of the needed K/V rows (in their own
dtype), then the kernel over each sender's rows. Backward: the same
exchange, the kernel's backward, and one all-to-all of the dK/dV partials
(float32; float64 for float64 inputs) back to their owners, summed there
(``namespace.sum_rows``).

``method="auto"`` (the attention functions' default) takes this path where
it moves at most ``SPARSE_SHARE`` of the ring's bytes on the busiest rank,
and the ring (which overlaps each hop with compute) otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, Tuple

import numpy as np

from ..namespace import accumulator_dtype, contiguous, device, namespace, sum_rows
from ..sequence.balanced import held_ranges
from ..sequence.blockwise import attend, attend_backward
from ..sequence.documents import Span, local_index
from ..sequence.kv import joined, split
from ..sequence.visibility import mask_blocks

__all__ = ["Routes", "routes", "sparse_forward", "sparse_backward", "SPARSE_SHARE"]

# the sparse exchange moves its bytes in one all-to-all that nothing
# overlaps; the ring overlaps every hop with a block's compute, so it keeps
# the mask unless the exchange moves clearly less
SPARSE_SHARE = 0.75


@dataclass(frozen=True)
class Routes:
    """``rows[src][dst]``: the rows of rank src's shard (local indices, in
    order) that rank dst's queries see; ``spans[src][dst]``: their global
    positions as spans (for the blocks)."""

    rows: Tuple[Tuple[np.ndarray, ...], ...]
    spans: Tuple[Tuple[Tuple[Span, ...], ...], ...]
    local_length: int

    def received(self, rank: int) -> int:
        """Rows rank receives from the others."""
        return sum(int(self.rows[src][rank].size) for src in range(len(self.rows))
                   if src != rank)

    def counts(self, rank: int) -> Tuple[np.ndarray, np.ndarray]:
        """(rows rank sends to each rank, rows it receives from each): both
        sides of its K/V exchange known from the routes, so no count exchange
        (and under jax.jit, the result's static shape)."""
        size = len(self.rows)
        return (np.array([self.rows[rank][dst].size for dst in range(size)], np.int64),
                np.array([self.rows[src][rank].size for src in range(size)], np.int64))

    def busiest_share(self) -> float:
        """The most rows any rank receives, against the ring's (P-1) shards."""
        size = len(self.rows)
        ring = (size - 1) * self.local_length
        return max(self.received(r) for r in range(size)) / ring if ring else 0.0


@functools.lru_cache(maxsize=64)
def routes(mask: Any, placement: Any) -> Routes:
    """Every pair of ranks' needed rows under ``mask`` for ``placement``."""
    size = placement.size
    index = [local_index(placement, rank) for rank in range(size)]
    needed = [mask.keys_seen(held_ranges(placement, rank)) for rank in range(size)]
    rows, spans = [], []
    for src in range(size):
        real = index[src] >= 0
        per_dst = tuple(np.flatnonzero(real & needed[dst][np.where(real, index[src], 0)])
                        for dst in range(size))
        rows.append(per_dst)
        spans.append(tuple(_spans_of(index[src][r]) for r in per_dst))
    return Routes(tuple(rows), tuple(spans), sum(s.length for s in placement.spans(0)))


def _spans_of(positions: np.ndarray) -> Tuple[Span, ...]:
    """Consecutive global positions as spans."""
    if positions.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = np.r_[0, breaks]
    stops = np.r_[breaks, positions.size]
    return tuple(Span(0, int(positions[a]), int(b - a), int(positions[a]))
                 for a, b in zip(starts, stops))


def _exchange(comm, k: Any, v: Any, plan: Routes) -> List[Any]:
    """This rank's needed rows of every rank's K and V: [n, b, rows, hk, w]
    (``kv.joined``) per sender, rank order (one all-to-all, rows along its
    first axis)."""
    xp = namespace(k)
    me = comm.rank
    rows_major = contiguous(xp.permute_dims(joined(k, v), (2, 0, 1, 3, 4)))
    picks = [plan.rows[me][dst] for dst in range(comm.size)]
    index = xp.asarray(np.concatenate(picks), device=device(k))
    arrived, counts = comm.alltoallv(xp.take(rows_major, index, axis=0), *plan.counts(me))
    edges = np.r_[0, np.cumsum(counts)].tolist()
    return [xp.permute_dims(arrived[a:b], (1, 2, 0, 3, 4)) for a, b in zip(edges, edges[1:])]


def sparse_forward(call: Any, q: Any, k: Any, v: Any, comm) -> Any:
    """The (out, lse) state (accumulator dtype) of this rank's queries over
    every key they see."""
    mask = call.visibility()
    plan, mine = routes(mask, call.placement), call.placement.spans(comm.rank)
    state = None
    for src, kv in enumerate(_exchange(comm, k, v, plan)):
        state = attend(call.kernel, q, *split(kv, k.shape[-1]),
                       mask_blocks(mask, mine, plan.spans[src][comm.rank]), call.scale, state)
    return state


def sparse_backward(call: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                    comm) -> Tuple[Any, Any]:
    """(dq, dK and dV ``kv.joined``, accumulator dtype) of this rank's shard:
    its queries' gradient over every key they see, and its keys' partials
    from every rank, summed."""
    xp = namespace(q)
    mask = call.visibility()
    plan, mine = routes(mask, call.placement), call.placement.spans(comm.rank)
    dq, partials = None, []
    for src, kv in enumerate(_exchange(comm, k, v, plan)):
        dq, dkv = attend_backward(call.kernel, dout, q, *split(kv, k.shape[-1]), out, lse,
                                  mask_blocks(mask, mine, plan.spans[src][comm.rank]),
                                  call.scale, dq)
        partials.append(xp.permute_dims(dkv, (2, 0, 1, 3, 4)))
    sent, received = plan.counts(comm.rank)
    back, _ = comm.alltoallv(xp.concat(partials, axis=0), received, sent)  # the way back
    owners = xp.asarray(np.concatenate([plan.rows[comm.rank][dst] for dst in range(comm.size)]),
                        device=device(q))
    summed = sum_rows(back, owners, k.shape[1], dtype=accumulator_dtype(q))
    return dq, xp.permute_dims(summed, (1, 2, 0, 3, 4))
