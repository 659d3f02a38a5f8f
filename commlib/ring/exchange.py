"""K/V rotation around the ring, double-buffered."""

from __future__ import annotations

from typing import Any, Iterator, Tuple


class RingExchange:
    """Rotates one block (K and V packed together: one message a step)
    around the ring of ``comm``, one hop a step: P-1 hops for P ranks, none
    on one rank. While the caller computes on the block of step i, the
    transfer of step i+1 is already in flight, into a second buffer."""

    def __init__(self, comm):
        self.comm = comm

    def rotate(self, block: Any) -> Iterator[Tuple[int, Any]]:
        """Yield ``(source_rank, block)`` for every rank's block: this rank's
        own first, then rank-1's, rank-2's, ... The block must not be
        modified by the caller (it is being sent)."""
        comm = self.comm
        current = block
        for step in range(comm.size):
            pending = comm.ring_shift_async(current) if step + 1 < comm.size else None
            yield (comm.rank - step) % comm.size, current
            if pending is not None:
                current = pending.wait()
