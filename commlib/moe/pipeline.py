"""Pipelined two-hop dispatch: the inter-node hop in chunks, each chunk
forwarded inside its node and expanded by its owners while the next ones
still cross (DeepEP forwards over NVLink while RDMA continues); combine the
same way, in reverse: each chunk's owners sum it and its forwarders send it
across while the owners sum the next.

Chunks. Hop 1 as one exchange would send it (each source's block to each
forwarder, its copies in token order) is cut into ``n`` consecutive pieces
per block, and chunk c is piece c of every block. A counted dispatch cuts by
token ranges (chunk c: tokens [c T / n, (c+1) T / n) of each rank, counted
in the dispatch's one read of the device); a fixed capacity cuts its fixed
blocks into equal slot ranges, so every size stays known in advance.

Overlap. Every chunk's hop 1 is posted at once. As chunk c lands, its
forwarder sends it on inside the node (hop 2 of chunk c), and its owner
writes the rows into expert_x (``commlib.moe.expand``) while chunk c + 1
crosses: over MPI, waiting on one transfer drives the progress of all of
them (and the progress thread moves them while Python computes, where it
runs). Combine asks the owner for chunk c's sums only when chunk c can
leave, so the first chunk crosses back while the owners still sum the rest.

Results. The owner's rows of an expert come chunk after chunk, each chunk's
in the order it arrived (forwarder, then source, then token), so one chunk
(``pipeline_chunks=1``) is one exchange's order. Whatever the chunk count,
every float32 sum adds the same terms in the same order (an owner sums an
arrival's experts in expert order, a forwarder its owners in rank order,
a source a token's copies in forwarder order), so from the same expert
rows combine and dispatch's gradient are one exchange's bit for bit, and so
are the stats. An expert whose result for a row depends on where the row
sits (a matrix product's edge rows may round differently) can differ in
the last bits, as can a sum over an expert's rows (its weights' gradient).

The chunk count: ``Dispatcher(..., pipeline_chunks=n)`` (the core and torch
Dispatchers; checked by ``contract.chunks_problem``), or by default the
largest of 8, 4, 2, 1 that leaves at least ``MIN_CHUNK_BYTES`` per chunk of
the largest block any rank sends to another node (the same on every rank:
the counted dispatch learns every rank's largest block in its count
exchange; a fixed capacity's blocks are fixed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..namespace import namespace, sum_rows
from .hops import Hop, take_sent

# the most chunks chosen by default, and the fewest bytes of the largest
# inter-node block in each: a chunk costs a few framework operations and two
# more MPI exchanges per hop (a few hundred microseconds on a CPU core),
# which 1 MiB keeps within a few percent of the chunk's own transfer up to
# about 10 Gbit/s; faster links have little forwarding left to hide
AUTO_MOST_CHUNKS = 8
MIN_CHUNK_BYTES = 1 << 20


def auto_chunks(block_bytes: int) -> int:
    """The default chunk count for the largest inter-node block of
    ``block_bytes``: the largest of 8, 4, 2, 1 whose chunks hold at least
    ``MIN_CHUNK_BYTES`` each (1 below that)."""
    chunks = AUTO_MOST_CHUNKS
    while chunks > 1 and block_bytes < chunks * MIN_CHUNK_BYTES:
        chunks //= 2
    return chunks


def token_chunks(rows: Any, tokens: int, chunks: int) -> Any:
    """The chunk of each token index in ``rows`` (device integers): chunk c
    holds tokens [floor(c T / n), floor((c+1) T / n)), so a chunk of n / 2
    is two chunks of n."""
    return ((rows + 1) * chunks - 1) // max(tokens, 1)


def even_pieces(block_rows: np.ndarray, chunks: int) -> np.ndarray:
    """[chunks, P]: a block of h rows cut into ``chunks`` slot ranges,
    piece c holding rows [floor(h c / n), floor(h (c+1) / n))."""
    edges = (np.asarray(block_rows, np.int64)[None, :]
             * np.arange(chunks + 1, dtype=np.int64)[:, None]) // chunks
    return np.diff(edges, axis=0)


@dataclass
class ChunkCounts:
    """Rows per chunk of a counted two-hop dispatch, host int64 [chunks, P],
    and the (arrival, expert) pairs this rank owns in each chunk."""

    sent: np.ndarray       # hop 1: to each rank
    received: np.ndarray   # hop 1: from each rank
    forwarded: np.ndarray  # hop 2, this rank forwarding: to each rank of its node
    delivered: np.ndarray  # hop 2, this rank owning: from each rank of its node
    pairs: np.ndarray      # [chunks]: assignments to this rank's experts


def exchange_counts(comm, send: np.ndarray, forward: np.ndarray, assigned: np.ndarray,
                    chunks: Optional[int], row_bytes: int) -> ChunkCounts:
    """One host all-to-all before hop 1: every rank tells each forwarder the
    rows it sends it per chunk and how many of them go on to each owner of
    the forwarder's node, tells each owner how many of its rows and of its
    assignments reach it per chunk, and tells everyone the largest block it
    sends to another node (whence the default chunk count, alike
    everywhere). ``send``, ``forward`` and ``assigned``: [fine, P] this
    rank's rows per chunk of ``chunks`` (or of ``AUTO_MOST_CHUNKS``, merged
    after) to each hop-1 destination, rows to each owner, and assignments
    to each owner. No rank needs to look at its device again for a count."""
    topology, size, me = comm.topology, comm.size, comm.rank
    fine = send.shape[0]
    nodes = [list(topology.ranks_of(topology.node_of(r))) for r in range(size)]
    mine, local = nodes[me], topology.local_rank
    width = len(mine)
    owned = fine * (1 + width)  # where the columns for r as an owner start
    table = np.zeros((size, owned + 2 * fine + 1), np.int64)
    table[:, :fine] = send.T
    for r in range(size):
        if nodes[r][local] == r:  # this rank's forwarder on r's node
            table[r, fine:owned] = forward[:, nodes[r]].reshape(-1)
    table[:, owned:owned + fine] = forward.T
    table[:, owned + fine:-1] = assigned.T
    away = np.array([topology.node_of(r) != topology.node_of(me) for r in range(size)])
    table[:, -1] = send[:, away].sum(axis=0).max(initial=0)
    received = np.asarray(comm.alltoall(table))
    count = chunks or auto_chunks(int(received[:, -1].max()) * row_bytes)
    forwarded = np.zeros((fine, size), np.int64)
    forwarded[:, mine] = received[:, fine:owned].reshape(size, fine, width).sum(0)
    delivered = np.zeros((fine, size), np.int64)
    for source in range(size):  # its rows reach this rank through its rail's rank here
        delivered[:, mine[nodes[source].index(source)]] += received[source, owned:owned + fine]

    def merged(per_chunk: np.ndarray) -> np.ndarray:
        return per_chunk.reshape(count, fine // count, -1).sum(axis=1)
    return ChunkCounts(merged(send), merged(received[:, :fine].T), merged(forwarded),
                       merged(delivered),
                       merged(received[:, owned + fine:-1].sum(axis=0)[:, None])[:, 0])


def joined(parts: Sequence[Any], empty: Any = None) -> Any:
    """``parts`` concatenated along axis 0 (``empty`` when there are none)."""
    if not parts:
        return empty
    if len(parts) == 1:
        return parts[0]
    return namespace(parts[0]).concat(list(parts), axis=0)


class Departures:
    """Hop 1 in flight chunk by chunk: chunk c + 1 leaves as soon as chunk c
    has landed, so one chunk crosses at a time. Chunks posted together
    share the link and all land near the end, with nothing forwarded
    meanwhile (measured across 300 Mbit/s links, four 2 MB chunks per rank:
    posted together, the first landed after 190-300 ms of 450 ms; one at a
    time, after 85-150 ms, and the last no later)."""

    def __init__(self, comm, route: "TwoHopRoute", message: Callable[[int], Any]):
        self._comm, self._route = comm, route
        self._messages = [message(chunk) for chunk in range(route.chunks)]
        self._pending = self._post(0)

    def _post(self, chunk: int) -> Any:
        message, self._messages[chunk] = self._messages[chunk], None
        return self._comm.alltoallv_async(message, self._route.sent[chunk],
                                          self._route.received[chunk])

    def landed(self, chunk: int) -> Any:
        """Chunk ``chunk``'s arrivals (chunks in order), the next one sent."""
        arrived = self._pending.wait()
        if chunk + 1 < self._route.chunks:
            self._pending = self._post(chunk + 1)
        return arrived


@dataclass
class TwoHopRoute:
    """A two-hop dispatch's path, chunk by chunk (``DispatchHandle.route``):
    hop 1 as one exchange sends it, cut into chunks, and each chunk's hop 2
    from this rank as forwarder. The owner's arrivals are the chunks' hop-2
    arrivals, one chunk after the other. ``token_ranges``: chunk c holds
    tokens [c T / n, (c+1) T / n) (a counted dispatch), so a token's copies
    all travel in one chunk and each chunk is summed at the source as it
    comes back; otherwise (a fixed capacity's slot ranges) the source sums
    once all are back, in one exchange's order."""

    first: Hop             # hop 1 as one exchange: a block per forwarder, copies in token order
    sent: np.ndarray       # [chunks, P] rows of each of this rank's blocks in each chunk
    received: np.ndarray   # [chunks, P] rows from each rank in each chunk
    token_ranges: bool
    second: List[Hop] = field(default_factory=list)  # hop 2 of each chunk, from this rank

    @property
    def chunks(self) -> int:
        return int(self.sent.shape[0])

    def chunk_rows(self, chunk: int) -> Any:
        """Hop 1's sent rows of ``chunk``: its piece of every block."""
        rows = self.first.send_rows
        begin = (np.cumsum(self.first.send_counts) - self.first.send_counts
                 + self.sent[:chunk].sum(axis=0))
        return joined([rows[b:b + n] for b, n in zip(begin.tolist(), self.sent[chunk].tolist())
                       if n], rows[:0])

    # the route protocol (as ``Hop``'s)
    def start(self, comm, message: Callable[[int], Any]) -> Departures:
        """Hop 1's first chunk in flight, ``message(c)`` being chunk c's rows."""
        return Departures(comm, self, message)

    def arriving(self, comm, started: Departures,
                 forward_chunk: Callable[[int, Any], Tuple[Any, Hop]]) -> Iterator[Any]:
        """The owner's arrivals, chunk after chunk: each chunk's hop-1
        arrivals sent on inside the node as they land (``forward_chunk(c,
        arrived)``: the rows and the hop), and the chunk's hop-2 arrivals
        handed over while the next chunk crosses."""
        for chunk in range(self.chunks):
            message, hop = forward_chunk(chunk, started.landed(chunk))
            yield comm.alltoallv_async(message, hop.send_counts, hop.recv_counts).wait()

    def split(self, rows: Any) -> Callable[[int], Any]:
        """The owner's per-arrival rows, chunk c's being ``split(rows)(c)``."""
        ends = np.cumsum([int(hop.recv_counts.sum()) for hop in self.second]).tolist()
        return lambda chunk: rows[(ends[chunk - 1] if chunk else 0):ends[chunk]]

    def send(self, comm, rows: Any) -> Any:
        """Source rows [sources, ...] to the owner's arrivals along the
        dispatch's hops, pipelined as the dispatch was."""
        started = self.start(comm, lambda c: take_sent(rows, self.chunk_rows(c),
                                                       self.first.sources))
        return joined(list(self.arriving(comm, started, lambda c, arrived: (
            take_sent(arrived, self.second[c].send_rows, self.second[c].sources),
            self.second[c]))))

    def back(self, comm, rows: Callable[[int], Any], wire: Any) -> Callable[[], Any]:
        """The owner's arrival rows back to the source rows, summed (the
        adjoint of ``send``), travelling as ``wire``, chunk by chunk: chunk
        c's rows (``rows(c)``) go back inside the node, its forwarder sums
        them and sends them across (once chunk c - 1 is across: one crosses
        at a time, as in ``Departures``) before the owner makes chunk c + 1's.
        The returned call takes the last chunk back and gives the sums."""
        landed: List[Any] = []
        crossing = None
        for chunk, hop in enumerate(self.second):
            part = rows(chunk)
            xp = namespace(part)
            inside = comm.alltoallv_async(xp.astype(part, wire, copy=False), hop.recv_counts,
                                          hop.send_counts)
            summed = xp.astype(hop.sum_back(inside.wait()), wire, copy=False)
            if crossing is not None:
                landed.append(self._at_source(chunk - 1, crossing.wait()))
            crossing = comm.alltoallv_async(summed, self.received[chunk], self.sent[chunk])

        def finish() -> Any:
            landed.append(self._at_source(self.chunks - 1, crossing.wait()))
            summed = joined(landed) if self.token_ranges \
                else self.first.sum_back(self._one_exchange(landed))
            return namespace(summed).astype(summed, wire, copy=False)
        return finish

    def _at_source(self, chunk: int, back: Any) -> Any:
        """Chunk ``chunk``'s rows back at the source: summed onto its token
        range now where chunks are token ranges, else kept for the sum."""
        if not self.token_ranges:
            return back
        tokens, chunks = self.first.sources, self.chunks
        low, high = chunk * tokens // chunks, (chunk + 1) * tokens // chunks
        return sum_rows(back, self.chunk_rows(chunk) - low, high - low,
                        dtype=namespace(back).float32)

    def _one_exchange(self, parts: List[Any]) -> Any:
        """Hop 1's rows back from each chunk (block by block within each) in
        one exchange's order: block by block, each block's pieces in chunk
        order."""
        within = np.cumsum(self.sent, axis=1) - self.sent  # where block d starts in chunk c
        pieces = [parts[c][int(within[c, d]):int(within[c, d] + self.sent[c, d])]
                  for d in range(self.sent.shape[1]) for c in range(self.chunks)
                  if self.sent[c, d]]
        return joined(pieces, parts[0][:0])
