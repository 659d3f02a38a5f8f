"""One all-to-all hop of a dispatch, and its way back: which rows go to
which rank, and how the rows that return are summed onto the rows they
left from. Flat dispatch is one such hop; the two-hop route
(``commlib.moe.pipeline``) is made of them.

Both are *routes*, with one protocol, chunk by chunk (a hop is one chunk):
``start`` posts the first hop, ``arriving`` yields the owner's arrivals
chunk after chunk as they land, ``back`` takes per-arrival rows back to the
tokens, asking for each chunk's rows only when that chunk can leave, and
``send`` / ``split`` serve the gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np

from ..namespace import device, namespace, sum_rows, take_rows


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
    Under a fixed capacity a sent row equal to ``sources`` is an empty slot.
    ``recv_counts`` None: learned from the count exchange when it starts."""

    send_rows: Any                    # caller's framework: source row of each sent row
    send_counts: np.ndarray           # host int64 [P]
    recv_counts: Optional[np.ndarray]  # host int64 [P]
    sources: int                      # rows on the sending side

    def sum_back(self, back: Any) -> Any:
        """Rows that came back along this hop (one per sent row), summed in
        float32 onto the source rows they left from; empty slots land on a
        spare row, cut off."""
        xp = namespace(back)
        return sum_rows(back, self.send_rows, self.sources + 1, dtype=xp.float32)[:self.sources]

    # the route protocol (``DispatchHandle.route``): flat dispatch is one hop, one chunk
    chunks = 1

    def start(self, comm, message: Callable[[int], Any]) -> List[Any]:
        """The hop in flight, ``message(0)`` being its rows."""
        pending = comm.alltoallv_async(message(0), self.send_counts, self.recv_counts)
        self.recv_counts = pending.recv_counts
        return [pending]

    def arriving(self, comm, started: List[Any],
                 forward_chunk: Optional[Callable] = None) -> Iterator[Any]:
        """The arrivals, as one chunk."""
        yield started[0].wait()

    def split(self, rows: Any) -> Callable[[int], Any]:
        """Per-arrival rows as chunks: one."""
        return lambda chunk: rows

    def send(self, comm, rows: Any) -> Any:
        """Source rows [sources, ...] to the arrivals, one copy per sent row."""
        arrived, _ = comm.alltoallv(take_sent(rows, self.send_rows, self.sources),
                                    self.send_counts, self.recv_counts)
        return arrived

    def back(self, comm, rows: Callable[[int], Any], wire: Any) -> Callable[[], Any]:
        """Arrival rows (``rows(0)``) back to the source rows, summed (the
        adjoint of ``send``), travelling as ``wire``: started now, finished
        by the returned call."""
        sent = rows(0)
        xp = namespace(sent)
        pending = comm.alltoallv_async(xp.astype(sent, wire, copy=False), self.recv_counts,
                                       self.send_counts)
        return lambda: xp.astype(self.sum_back(pending.wait()), wire, copy=False)


def copy_keys(dest: Any) -> Tuple[Any, Any]:
    """``dest`` [rows, k] (-1: nowhere) as sorted keys ``dest * rows + row``
    and the mask of the keys that start a distinct (destination, row) copy:
    one copy per distinct pair, rank-major. Fixed sizes: nothing is read on
    the host."""
    xp = namespace(dest)
    rows = dest.shape[0]
    row = xp.arange(rows, dtype=dest.dtype, device=device(dest))
    keys = xp.sort(xp.reshape(dest * rows + row[:, None], (-1,)))
    first = xp.concat([xp.ones(min(1, keys.shape[0]), dtype=xp.bool, device=device(dest)),
                       keys[1:] != keys[:-1]])
    return keys, first & (keys >= 0)  # invalid slots have negative keys


def lookup(table: Any, ids: Any) -> Any:
    """``table[ids]`` where ``ids >= 0``, -1 elsewhere (same shape as ids)."""
    xp = namespace(ids)
    valid = ids >= 0
    found = xp.take(table, xp.reshape(xp.where(valid, ids, 0), (-1,)))
    return xp.where(valid, xp.reshape(found, ids.shape), -1)
