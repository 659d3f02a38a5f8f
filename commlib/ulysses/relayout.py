"""Ulysses' sequence <-> head relayout: one all-to-all each way.

``seq_to_head``: [b, s/P, h, d] -> [b, s, h/P, d]: every rank gives each peer
the heads that peer will own, for this rank's part of the sequence, and gets
back its heads for the whole sequence. ``head_to_seq`` is the inverse.

K/V under GQA: with ``kv_heads`` a multiple of P the kv heads split like the
query heads. With ``kv_heads < P`` (and P a multiple of it) rank r's query
heads all use one kv head, ``r // (P / kv_heads)``, and only that head is
sent to it: no traffic for copies nobody reads. On the way back (gradients)
the copies of a kv head are summed.

``seq_to_head_many`` relays several tensors in one all-to-all, one message
per peer, instead of one all-to-all per tensor.
"""

from __future__ import annotations

import math
from typing import Any, List, Sequence

import numpy as np

from ..namespace import contiguous, device, namespace


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(heads: int, size: int, what: str = "heads") -> None:
    """Query heads must split evenly over the Ulysses degree."""
    if heads % size:
        working = [d for d in divisors(heads) if d <= max(size, heads)]
        raise ValueError(f"{what} ({heads}) do not split over a Ulysses degree of {size}; "
                         f"degrees that work for {heads} heads: {working}")


def kv_heads_for(rank: int, kv_heads: int, size: int) -> np.ndarray:
    """Indices of the kv heads rank owns after seq_to_head."""
    if kv_heads % size == 0:
        per_rank = kv_heads // size
        return np.arange(rank * per_rank, (rank + 1) * per_rank)
    if size % kv_heads == 0:
        return np.array([rank // (size // kv_heads)])
    raise ValueError(f"kv heads ({kv_heads}) must be a multiple of the Ulysses degree ({size}), "
                     f"or divide it: degrees that work are {divisors(kv_heads)} and the "
                     f"multiples of {kv_heads}")


def _replicated(kv_heads: int, size: int) -> bool:
    """Whether kv heads are fewer than the ranks (each rank gets a copy of
    one kv head) rather than split among them."""
    return kv_heads % size != 0


def _send_layout(x, size: int):
    """[b, sl, H, d] -> [P, b, sl, H', d] contiguous, destination first, in
    x's framework (H' = H / P, or 1 replicated kv head per destination)."""
    xp = namespace(x)
    heads = x.shape[2]
    if _replicated(heads, size):  # send each rank the one kv head it reads
        owner = np.concatenate([kv_heads_for(r, heads, size) for r in range(size)])
        x = xp.take(x, xp.asarray(owner, device=device(x)), axis=2)
    b, sl, h, d = x.shape
    per = h // size
    return contiguous(xp.permute_dims(xp.reshape(x, (b, sl, size, per, d)), (2, 0, 1, 3, 4)))


# above this many bytes per peer, one packed message is no faster than one
# message per tensor (measured here: 1.7x faster at 24 KB per peer, slower at
# 98 KB, where MPICH switches from eager to rendezvous; docs/ulysses.md)
FUSE_LIMIT_BYTES = 48 * 1024


def seq_to_head_many(tensors: Sequence[Any], comm) -> List[Any]:
    """Relayout several [b, s/P, h_i, d_i] tensors (same b and s/P) in one
    all-to-all when the messages are small (latency-bound), one each when
    they are large; returns [b, s, h_i/P, d_i] each (kv-style heads as in
    the module docstring), in each input's framework."""
    size = comm.size
    sends = [_send_layout(t, size) for t in tensors]
    per_peer = sum(math.prod(s.shape) * s.dtype.itemsize for s in sends) // size
    if len(sends) == 1 or per_peer > FUSE_LIMIT_BYTES:
        received = [comm.alltoall(s) for s in sends]
    else:
        received = comm.alltoall_many(sends)
    results = []
    for block in received:
        xp = namespace(block)
        _, b, sl, per, d = block.shape
        # [P (source = sequence chunk), b, sl, per, d] -> [b, P * sl, per, d]
        results.append(xp.reshape(xp.permute_dims(block, (1, 0, 2, 3, 4)),
                                  (b, size * sl, per, d)))
    return results


def seq_to_head(x: Any, comm) -> Any:
    """[b, s/P, h, d] -> [b, s, h/P, d] (see the module docstring for kv heads)."""
    return seq_to_head_many([x], comm)[0]


def head_to_seq(x: Any, comm, heads: int = None) -> Any:
    """[b, s, h/P, d] -> [b, s/P, h, d]. ``heads`` is the global head count
    when it differs from h/P * P, i.e. kv heads fewer than the ranks: then
    the copies each rank holds are summed into the single original (the
    gradient of seq_to_head's replication)."""
    xp = namespace(x)
    size = comm.size
    b, s, per, d = x.shape
    heads = per * size if heads is None else heads
    # send: sequence chunk p to rank p: [P, b, s/P, per, d]
    send = contiguous(xp.permute_dims(xp.reshape(x, (b, size, s // size, per, d)),
                                      (1, 0, 2, 3, 4)))
    received = comm.alltoall(send)  # [P (source = head owner), b, s/P, per, d]
    owned = xp.reshape(xp.permute_dims(received, (1, 2, 0, 3, 4)),
                       (b, s // size, size * per, d))
    if not _replicated(heads, size):
        return owned
    # rank r held kv head r // (P / heads): copies of a head are adjacent
    return xp.sum(xp.reshape(owned, (b, s // size, heads, size // heads, d)), axis=3)
