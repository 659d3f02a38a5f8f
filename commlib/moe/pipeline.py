"""Pipelined two-hop dispatch: the inter-node hop in chunks, each chunk
forwarded inside its node while the next ones still cross (DeepEP forwards
over NVLink while RDMA continues); combine the same way, in reverse.

Chunks. Hop 1 as one exchange would send it (each source's block to each
forwarder, its copies in token order) is cut into ``n`` consecutive pieces
per block, and chunk c is piece c of every block. A counted dispatch cuts by
token ranges (chunk c: tokens [c T / n, (c+1) T / n) of each rank, counted
in the dispatch's one read of the device); a fixed capacity cuts its fixed
blocks into equal slot ranges, so every size stays known in advance.

Overlap. Every chunk's hop 1 is posted at once. As chunk c lands, its
forwarder sends it on inside the node (hop 2 of chunk c) and goes on to wait
for chunk c + 1: over MPI, waiting on one transfer drives the progress of
all of them, so chunk c's forwarding moves while chunk c + 1 crosses (and
the progress thread moves both while Python computes, where it runs).
Combine posts every chunk's way back inside the node at once, and sends each
chunk across as soon as its forwarder has summed it.

Same result as one exchange, row for row and bit for bit. The owner's rows
arrive chunk after chunk; each hop-2 row carries its place in the
unpipelined order (the forwarder's rank and the row's position among the
forwarder's hop-1 arrivals as one exchange places them: 8 bytes, inside the
node only), and the owner groups the rows by expert in that order, so
expert_x is the unpipelined one. On the way back, each chunk returns along
its own hops, and the source puts hop 1's pieces back into one exchange's
order before it sums them, so every float32 sum adds the same terms in the
same order.

The chunk count: ``Dispatcher(pipeline_chunks=n)``, or by default the
largest of 8, 4, 2, 1 that leaves at least ``MIN_CHUNK_BYTES`` per chunk of
the largest block any rank sends to another node (the same on every rank:
the counted dispatch learns every rank's largest block in its count
exchange; a fixed capacity's blocks are fixed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..namespace import as_bytes, device, from_bytes, namespace
from .hops import Hop, take_sent

# the most chunks chosen by default, and the fewest bytes of the largest
# inter-node block in each: a chunk costs a few framework operations and two
# more MPI exchanges per hop (a few hundred microseconds on a CPU core),
# which 1 MiB keeps within a few percent of the chunk's own transfer up to
# about 10 Gbit/s; faster links have little forwarding left to hide
AUTO_MOST_CHUNKS = 8
MIN_CHUNK_BYTES = 1 << 20
# what a hop-2 row carries beside its metadata when pipelined: its
# forwarder's rank and its position there, int32 each
ORIGIN_BYTES = 8


def chunks_problem(chunks: Any) -> Optional[ValueError]:
    """What is wrong with a ``pipeline_chunks`` option (None: nothing)."""
    if chunks is None or (isinstance(chunks, int) and not isinstance(chunks, bool)
                          and chunks >= 1):
        return None
    return ValueError(f"pipeline_chunks must be a positive integer (the chunks a two-hop "
                      f"dispatch cuts its inter-node hop into; 1: no pipelining) or None "
                      f"(chosen from the bytes), got {chunks!r}")


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
    """Rows per chunk of a counted two-hop dispatch, host int64 [chunks, P]."""

    sent: np.ndarray       # hop 1: to each rank
    received: np.ndarray   # hop 1: from each rank
    forwarded: np.ndarray  # hop 2, this rank forwarding: to each rank of its node
    delivered: np.ndarray  # hop 2, this rank owning: from each rank of its node


def exchange_counts(comm, send: np.ndarray, forward: np.ndarray, chunks: Optional[int],
                    row_bytes: int) -> ChunkCounts:
    """One host all-to-all before hop 1: every rank tells each forwarder the
    rows it sends it per chunk and how many of them go on to each owner of
    the forwarder's node, tells each owner how many of its rows reach it per
    chunk, and tells everyone the largest block it sends to another node
    (whence the default chunk count, alike everywhere). ``send`` and
    ``forward``: [fine, P] this rank's rows per chunk of ``chunks`` (or of
    ``AUTO_MOST_CHUNKS``, merged after) to each hop-1 destination and each
    owner. No rank needs to look at its device again for a count."""
    topology, size, me = comm.topology, comm.size, comm.rank
    fine = send.shape[0]
    nodes = [list(topology.ranks_of(topology.node_of(r))) for r in range(size)]
    mine, local = nodes[me], topology.local_rank
    width = len(mine)
    table = np.zeros((size, fine * (2 + width) + 1), np.int64)
    table[:, :fine] = send.T
    for r in range(size):
        if nodes[r][local] == r:  # this rank's forwarder on r's node
            table[r, fine:fine * (1 + width)] = forward[:, nodes[r]].reshape(-1)
    table[:, fine * (1 + width):-1] = forward.T
    away = np.array([topology.node_of(r) != topology.node_of(me) for r in range(size)])
    table[:, -1] = send[:, away].sum(axis=0).max(initial=0)
    received = np.asarray(comm.alltoall(table))
    count = chunks or auto_chunks(int(received[:, -1].max()) * row_bytes)
    forwarded = np.zeros((fine, size), np.int64)
    forwarded[:, mine] = received[:, fine:fine * (1 + width)].reshape(size, fine, width).sum(0)
    delivered = np.zeros((fine, size), np.int64)
    for source in range(size):  # its rows reach this rank through its rail's rank here
        delivered[:, mine[nodes[source].index(source)]] += received[source, fine * (1 + width):-1]

    def merged(per_chunk: np.ndarray) -> np.ndarray:
        return per_chunk.reshape(count, fine // count, size).sum(axis=1)
    return ChunkCounts(merged(send), merged(received[:, :fine].T), merged(forwarded),
                       merged(delivered))


def _joined(parts: Sequence[Any], empty: Any = None) -> Any:
    """``parts`` concatenated along axis 0 (``empty`` when there are none)."""
    if not parts:
        return empty
    if len(parts) == 1:
        return parts[0]
    return namespace(parts[0]).concat(list(parts), axis=0)


@dataclass
class TwoHopRoute:
    """A two-hop dispatch's path, chunk by chunk (``DispatchHandle.route``):
    hop 1 as one exchange sends it, cut into chunks, and each chunk's hop 2
    from this rank as forwarder. The owner's arrivals are the chunks' hop-2
    arrivals, one chunk after the other."""

    first: Hop             # hop 1 as one exchange: a block per forwarder, copies in token order
    sent: np.ndarray       # [chunks, P] rows of each of this rank's blocks in each chunk
    received: np.ndarray   # [chunks, P] rows from each rank in each chunk
    second: List[Hop] = field(default_factory=list)  # hop 2 of each chunk, from this rank

    @property
    def chunks(self) -> int:
        return int(self.sent.shape[0])

    @property
    def origin_bytes(self) -> int:
        """Bytes a hop-2 row carries after its metadata (none unpipelined)."""
        return ORIGIN_BYTES if self.chunks > 1 else 0

    def chunk_rows(self, chunk: int) -> Any:
        """Hop 1's sent rows of ``chunk``: its piece of every block."""
        rows = self.first.send_rows
        begin = (np.cumsum(self.first.send_counts) - self.first.send_counts
                 + self.sent[:chunk].sum(axis=0))
        return _joined([rows[b:b + n] for b, n in zip(begin.tolist(), self.sent[chunk].tolist())
                        if n], rows[:0])

    def start(self, comm, message: Callable[[int], Any]) -> List[Any]:
        """Every chunk's hop 1 in flight, ``message(c)`` being chunk c's rows."""
        return [comm.alltoallv_async(message(c), self.sent[c], self.received[c])
                for c in range(self.chunks)]

    def forward(self, comm, started: List[Any],
                forward_chunk: Callable[[int, Any], Tuple[Any, Hop]]) -> Any:
        """Each chunk's hop-1 arrivals sent on as they land
        (``forward_chunk(c, arrived)``: the rows and the hop), while the
        later chunks still cross. Returns the owner's arrivals."""
        landed = []
        for chunk, pending in enumerate(started):
            message, hop = forward_chunk(chunk, pending.wait())
            landed.append(comm.alltoallv_async(message, hop.send_counts, hop.recv_counts))
        return _joined([pending.wait() for pending in landed])

    def stamp(self, chunk: int, arrived: Any, meta_bytes: int, rank: int) -> Any:
        """``chunk``'s hop-1 arrivals at this forwarder (``rank``) with each
        row's origin after its ``meta_bytes`` of metadata: this rank and the
        row's position in one exchange's arrivals (sources in rank order,
        each source's rows in token order). Unchanged unpipelined."""
        if self.chunks == 1:
            return arrived
        xp, where = namespace(arrived), device(arrived)
        per_source = self.received.sum(axis=0)
        begin = np.cumsum(per_source) - per_source + self.received[:chunk].sum(axis=0)
        position = _joined([xp.arange(b, b + n, dtype=xp.int32, device=where)
                            for b, n in zip(begin.tolist(), self.received[chunk].tolist()) if n],
                           xp.zeros(0, dtype=xp.int32, device=where))
        origin = xp.stack([xp.full(position.shape, rank, dtype=xp.int32, device=where),
                           position], axis=1)
        return xp.concat([arrived[:, :meta_bytes], as_bytes(origin), arrived[:, meta_bytes:]],
                         axis=1)

    def order(self, arrived: Any, meta_bytes: int) -> Optional[Any]:
        """The owner's arrivals listed in one exchange's order (by forwarder,
        then position there), from the origins ``stamp`` wrote; None
        unpipelined (the arrivals are in that order already)."""
        if self.chunks == 1:
            return None
        xp = namespace(arrived)
        origin = from_bytes(arrived[:, meta_bytes:meta_bytes + ORIGIN_BYTES], xp.int32, (2,))
        by_position = xp.argsort(origin[:, 1], stable=True)
        return xp.take(by_position, xp.argsort(xp.take(origin[:, 0], by_position), stable=True))

    # the route protocol (as ``Hop``'s)
    def send(self, comm, rows: Any) -> Any:
        """Source rows [sources, ...] to the owner's arrivals along the
        dispatch's hops, pipelined as the dispatch was."""
        started = self.start(comm, lambda c: take_sent(rows, self.chunk_rows(c),
                                                       self.first.sources))
        return self.forward(comm, started, lambda c, arrived: (
            take_sent(arrived, self.second[c].send_rows, self.second[c].sources),
            self.second[c]))

    def back(self, comm, rows: Any, wire: Any) -> Callable[[], Any]:
        """The owner's arrival rows back to the source rows, summed (the
        adjoint of ``send``), travelling as ``wire``: every chunk's way back
        inside the node started now; the returned call sends each chunk
        across once its forwarder has summed it, and sums at the source."""
        xp = namespace(rows)
        ends = np.cumsum([int(hop.recv_counts.sum()) for hop in self.second])
        started = [comm.alltoallv_async(xp.astype(rows[end - int(hop.recv_counts.sum()):end],
                                                  wire, copy=False),
                                        hop.recv_counts, hop.send_counts)
                   for hop, end in zip(self.second, ends.tolist())]

        def finish() -> Any:
            crossing = []
            for chunk, (hop, pending) in enumerate(zip(self.second, started)):
                summed = xp.astype(hop.sum_back(pending.wait()), wire, copy=False)
                crossing.append(comm.alltoallv_async(summed, self.received[chunk],
                                                     self.sent[chunk]))
            back = self._one_exchange([pending.wait() for pending in crossing])
            return xp.astype(self.first.sum_back(back), wire, copy=False)
        return finish

    def _one_exchange(self, parts: List[Any]) -> Any:
        """Hop 1's rows back from each chunk (block by block within each) in
        one exchange's order: block by block, each block's pieces in chunk
        order."""
        within = np.cumsum(self.sent, axis=1) - self.sent  # where block d starts in chunk c
        pieces = [parts[c][int(within[c, d]):int(within[c, d] + self.sent[c, d])]
                  for d in range(self.sent.shape[1]) for c in range(self.chunks)
                  if self.sent[c, d]]
        return _joined(pieces, parts[0][:0])
