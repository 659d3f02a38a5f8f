"""One all-to-all hop of a dispatch, and its way back: which rows go to
which rank, and how the rows that return are summed onto the rows they
left from. Flat dispatch is one such hop; the two-hop route
(``commlib.moe.pipeline``) is made of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..namespace import device, namespace, scatter_add, take_rows


def take_sent(rows: Any, send_rows: Any, sources: int) -> Any:
    """``rows[send_rows]`` where an index ``sources`` (an empty slot) takes
    any row: what such a slot carries is never read."""
    xp = namespace(send_rows)
    if sources == 0:
        return xp.zeros((send_rows.shape[0],) + tuple(rows.shape[1:]), dtype=rows.dtype,
                        device=device(rows))
    return take_rows(rows, xp.where(send_rows < sources, send_rows, 0))


@dataclass
class Hop:
    """One all-to-all hop: the source rows sent (rank-major) and the counts.
    Under a fixed capacity a sent row equal to ``sources`` is an empty slot."""

    send_rows: Any           # caller's framework: source row of each sent row, in send order
    send_counts: np.ndarray  # host int64 [P]
    recv_counts: np.ndarray  # host int64 [P]
    sources: int             # rows on the sending side

    def sum_back(self, back: Any) -> Any:
        """Rows that came back along this hop (one per sent row), summed in
        float32 onto the source rows they left from; empty slots land on a
        spare row, cut off."""
        xp = namespace(back)
        summed = xp.zeros((self.sources + 1,) + tuple(back.shape[1:]), dtype=xp.float32,
                          device=device(back))
        return scatter_add(summed, self.send_rows, back)[:self.sources]

    # the route protocol (``DispatchHandle.route``): flat dispatch is one hop
    def send(self, comm, rows: Any) -> Any:
        """Source rows [sources, ...] to the arrivals, one copy per sent row."""
        arrived, _ = comm.alltoallv(take_sent(rows, self.send_rows, self.sources),
                                    self.send_counts, self.recv_counts)
        return arrived

    def back(self, comm, rows: Any, wire: Any) -> Callable[[], Any]:
        """Arrival rows back to the source rows, summed (the adjoint of
        ``send``), travelling as ``wire``: started now, finished by the
        returned call."""
        xp = namespace(rows)
        pending = comm.alltoallv_async(xp.astype(rows, wire, copy=False), self.recv_counts,
                                       self.send_counts)
        return lambda: xp.astype(self.sum_back(pending.wait()), wire, copy=False)
