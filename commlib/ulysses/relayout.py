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

from typing import Any, List, Sequence

import numpy as np

from ..arrays import unwrap


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


def _head_order(kv_heads: int, size: int) -> np.ndarray:
    """Heads to send, destination by destination (each destination's block
    contiguous), for a tensor with ``kv_heads`` heads."""
    return np.concatenate([kv_heads_for(r, kv_heads, size) for r in range(size)])


def _send_layout(data, heads_total: int, size: int, xp):
    """[b, sl, H, d] -> [P, b, sl, H/P', d] contiguous, destination first."""
    order = _head_order(heads_total, size)
    if len(order) != heads_total or (order != np.arange(heads_total)).any():
        data = data[:, :, xp.asarray(order)]  # replicate kv heads that several ranks read
    b, sl, h, d = data.shape
    per = h // size
    return xp.ascontiguousarray(data.reshape(b, sl, size, per, d).transpose(2, 0, 1, 3, 4))


# above this many bytes per peer, one packed message is no faster than one
# message per tensor (measured here: 1.7x faster at 24 KB per peer, slower at
# 98 KB, where MPICH switches from eager to rendezvous; docs/ulysses.md)
FUSE_LIMIT_BYTES = 48 * 1024


def seq_to_head_many(tensors: Sequence[Any], comm) -> List[Any]:
    """Relayout several [b, s/P, h_i, d_i] tensors (same b and s/P) in one
    all-to-all when the messages are small (latency-bound), one each when
    they are large; returns [b, s, h_i/P, d_i] each (kv-style heads as in
    the module docstring), in each input's framework."""
    natives = [unwrap(t) for t in tensors]
    xp = natives[0].xp
    size = comm.size
    per_peer = sum(n.data.nbytes for n in natives) // size
    if len(natives) > 1 and per_peer > FUSE_LIMIT_BYTES:
        return [seq_to_head_many([t], comm)[0] for t in tensors]
    parts = []
    for native in natives:
        heads = native.data.shape[2]
        send = _send_layout(native.data, heads, size, xp)
        parts.append(send.reshape(size, -1).view(np.uint8))
    # [P, bytes of every tensor]: one message per peer
    packed = parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=1)
    received = unwrap(comm.alltoall(packed)).data  # [P, ...]: row p from rank p
    results, offset = [], 0
    for native, part in zip(natives, parts):
        width = part.shape[1]
        b, sl, _, d = native.data.shape
        block = xp.ascontiguousarray(received[:, offset:offset + width]).view(native.data.dtype)
        per = block.size // (size * b * sl * d)
        # [P (source = sequence chunk), b, sl, per, d] -> [b, P * sl, per, d]
        full = block.reshape(size, b, sl, per, d).transpose(1, 0, 2, 3, 4).reshape(
            b, size * sl, per, d)
        results.append(native.wrap(xp.ascontiguousarray(full)))
        offset += width
    return results


def seq_to_head(x: Any, comm) -> Any:
    """[b, s/P, h, d] -> [b, s, h/P, d] (see the module docstring for kv heads)."""
    return seq_to_head_many([x], comm)[0]


def head_to_seq(x: Any, comm, heads: int = None) -> Any:
    """[b, s, h/P, d] -> [b, s/P, h, d]. ``heads`` is the global head count
    when it differs from h/P * P, i.e. kv heads fewer than the ranks: then
    the copies each rank holds are summed into the single original (the
    gradient of seq_to_head's replication)."""
    native = unwrap(x)
    xp = native.xp
    size = comm.size
    b, s, per, d = native.data.shape
    heads = per * size if heads is None else heads
    # send: sequence chunk p to rank p: [P, b, s/P, per, d]
    send = xp.ascontiguousarray(native.data.reshape(b, size, s // size, per, d)
                                .transpose(1, 0, 2, 3, 4))
    received = unwrap(comm.alltoall(send)).data  # [P (source = head owner), b, s/P, per, d]
    owned = received.transpose(1, 2, 0, 3, 4).reshape(b, s // size, size * per, d)
    order = _head_order(heads, size)
    if len(order) == heads:
        return native.wrap(xp.ascontiguousarray(owned[:, :, np.argsort(order)]))
    summed = xp.zeros((b, s // size, heads, d), dtype=owned.dtype)
    for position, head in enumerate(order):
        summed[:, :, head] += owned[:, :, position]
    return native.wrap(summed)
