"""Ulysses' sequence <-> head relayout: one all-to-all each way.

``seq_to_head``: [b, s/P, h, d] -> [b, s, h_p, d]: every rank gives each peer
the heads that peer will own, for this rank's part of the sequence, and gets
back its heads for the whole sequence. ``head_to_seq`` is the inverse.

Heads that P does not divide split unevenly, as DeepSpeed does: rank p owns
query heads ``head_split(h, P)[p]`` (the first h % P ranks one more). The
all-to-alls still exchange equal chunks, each padded with zero heads to the
largest rank's count and the padding dropped on receipt: the JAX binding
traces these functions on a communicator that has only equal-chunk
all-to-alls (``bindings/jax/_traced_comm.py``).

K/V under GQA (query head i uses kv head i // (h / hk)): a rank gets the kv
heads its own query heads use, once each where its query heads group evenly
over them (always, when P divides h and hk or P divides the other: kv heads
split like query heads, or each rank gets its one kv head), else one copy
per query head (the rank then attends as MHA). No rank gets a kv head it
does not read. On the way back (gradients) the copies of a kv head are
summed.

``seq_to_head_many`` relays several tensors in one all-to-all, one message
per peer, instead of one all-to-all per tensor. ``wire`` says how the
messages travel (``commlib.ulysses.wire``: the input dtype, or FP8); the
``_async`` forms return once the exchange is posted, with the wait that
finishes it (``commlib.ulysses.overlap``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..namespace import contiguous, device, namespace
from .wire import check_wire, relay


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_heads(heads: int, size: int, what: str = "heads") -> None:
    """Every rank must own at least one query head."""
    if heads < size:
        raise ValueError(f"{what} ({heads}) are fewer than the Ulysses degree ({size}), so a "
                         f"rank would own no head; use a Ulysses degree of at most {heads} "
                         f"(hybrid attention's ulysses_size; Ring takes any head count)")


def head_split(heads: int, size: int) -> List[Tuple[int, int]]:
    """Each rank's query heads [start, stop), counted like np.array_split."""
    check_heads(heads, size)
    base, extra = divmod(heads, size)
    bounds = [p * base + min(p, extra) for p in range(size + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def heads_here(per_head: Any, comm) -> Any:
    """The entries of a per-query-head array [h] (attention sinks) for the
    query heads this rank holds after seq_to_head (None stays None)."""
    if per_head is None:
        return None
    start, stop = head_split(per_head.shape[0], comm.size)[comm.rank]
    return per_head[start:stop]


def _query_heads(heads: int, size: int, query_heads: Optional[int]) -> int:
    """``query_heads``, by default a tensor's own heads; a lone tensor with
    fewer heads than ranks, dividing P, is kv heads read by P query heads
    (each rank gets the one kv head it reads, as before uneven splits)."""
    if query_heads is not None:
        return query_heads
    return size if 0 < heads < size and size % heads == 0 else heads


def kv_heads_for(rank: int, kv_heads: int, size: int,
                 query_heads: Optional[int] = None) -> np.ndarray:
    """The heads, in order, that ``rank`` holds after seq_to_head of a tensor
    with ``kv_heads`` heads (query heads when it equals ``query_heads``)."""
    query_heads = _query_heads(kv_heads, size, query_heads)
    if kv_heads < 1 or query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of kv heads "
                         f"({kv_heads}) for GQA/MQA")
    start, stop = head_split(query_heads, size)[rank]
    used = np.arange(start, stop) // (query_heads // kv_heads)
    heads, readers = np.unique(used, return_counts=True)
    return heads if (readers == readers[0]).all() else used


@functools.lru_cache(maxsize=256)
def _owned(heads: int, size: int, query_heads: Optional[int]) -> Tuple[np.ndarray, ...]:
    """Every rank's ``kv_heads_for``; made once per shape (every relayout
    asks), read-only since it is shared."""
    owned = tuple(kv_heads_for(p, heads, size, query_heads) for p in range(size))
    for mine in owned:
        mine.setflags(write=False)
    return owned


def padded_heads(heads: int, size: int, query_heads: Optional[int] = None) -> int:
    """Heads per all-to-all chunk for a tensor of ``heads`` heads: the
    largest rank's count (what the cost of the relayout scales with)."""
    return max(len(mine) for mine in _owned(heads, size, query_heads))


def _select(x: Any, heads: np.ndarray) -> Any:
    """x[:, :, heads]: a view where the heads are consecutive (they never
    decrease, so a span of len - 1 means consecutive: no array compared on
    every relayout)."""
    start = int(heads[0])
    if int(heads[-1]) - start == len(heads) - 1:
        return x[:, :, start:start + len(heads)]
    xp = namespace(x)
    return xp.take(x, xp.asarray(heads, device=device(x)), axis=2)


def _padded(x: Any, width: int) -> Any:
    """[b, s, n, d] -> [b, s, width, d], zero heads appended."""
    b, s, n, d = x.shape
    if n == width:
        return x
    xp = namespace(x)
    return xp.concat([x, xp.zeros((b, s, width - n, d), dtype=x.dtype, device=device(x))],
                     axis=2)


def _send_layout(x: Any, owned: Sequence[np.ndarray]) -> Any:
    """[b, sl, H, d] -> [P, b, sl, n, d] contiguous, destination first: each
    destination's heads, padded to n, the largest count."""
    width = max(len(heads) for heads in owned)
    return namespace(x).stack([_padded(_select(x, heads), width) for heads in owned])


# above this many bytes per peer, one packed message is no faster than one
# message per tensor (measured here: 1.7x faster at 24 KB per peer, slower at
# 98 KB, where MPICH switches from eager to rendezvous; docs/ulysses.md)
FUSE_LIMIT_BYTES = 48 * 1024


def seq_to_head_many(tensors: Sequence[Any], comm, num_heads: Optional[int] = None,
                     wire: Optional[str] = None) -> List[Any]:
    """Relayout several [b, s/P, h_i, d_i] tensors (same b and s/P) in one
    all-to-all when the messages are small (latency-bound), one each when
    they are large; returns each as [b, s, its heads here, d_i], in its own
    framework. ``num_heads`` is h, the query heads (default: tensors[0]'s
    heads, or P where those are fewer and divide P: a lone kv tensor, as
    before uneven splits); a tensor with another head count is kv heads
    (module docstring). ``wire``: how they travel (``commlib.ulysses.wire``)."""
    return seq_to_head_async(tensors, comm, num_heads, wire, asynchronous=False)()


def seq_to_head_async(tensors: Sequence[Any], comm, num_heads: Optional[int] = None,
                      wire: Optional[str] = None,
                      asynchronous: bool = True) -> Callable[[], List[Any]]:
    """``seq_to_head_many`` started: returns the wait that gives its result.
    The tensors must not change until then."""
    for t in tensors:
        check_wire(wire, t)
    size = comm.size
    query_heads = _query_heads(tensors[0].shape[2], size, num_heads)
    owned = [_owned(t.shape[2], size, query_heads) for t in tensors]
    sends = [_send_layout(t, heads) for t, heads in zip(tensors, owned)]
    per_peer = sum(math.prod(s.shape) * s.dtype.itemsize for s in sends) // size
    arrived = relay(comm, sends, wire, len(sends) > 1 and per_peer <= FUSE_LIMIT_BYTES,
                    asynchronous)

    def wait() -> List[Any]:
        results = []
        for block, heads in zip(arrived(), owned):
            xp = namespace(block)
            _, b, sl, _, d = block.shape
            mine = len(heads[comm.rank])
            # [P (source = sequence chunk), b, sl, n, d] -> [b, P * sl, mine, d]
            results.append(xp.reshape(xp.permute_dims(block[:, :, :, :mine], (1, 0, 2, 3, 4)),
                                      (b, size * sl, mine, d)))
        return results
    return wait


def seq_to_head(x: Any, comm, num_heads: Optional[int] = None,
                wire: Optional[str] = None) -> Any:
    """[b, s/P, h, d] -> [b, s, h_p, d] (see seq_to_head_many)."""
    return seq_to_head_many([x], comm, num_heads, wire)[0]


def head_to_seq(x: Any, comm, heads: Optional[int] = None,
                num_heads: Optional[int] = None, wire: Optional[str] = None) -> Any:
    """[b, s, h_p, d] -> [b, s/P, h, d], the inverse (and adjoint) of
    seq_to_head: ``heads`` = h, x's own heads (default h_p * P, right for
    even splits), ``num_heads`` the query heads as seq_to_head's when x
    holds kv heads. Copies of a kv head on several ranks are summed (the
    gradient of the replication). ``wire``: how it travels."""
    return head_to_seq_async(x, comm, heads, num_heads, wire, asynchronous=False)()


def head_to_seq_async(x: Any, comm, heads: Optional[int] = None,
                      num_heads: Optional[int] = None, wire: Optional[str] = None,
                      asynchronous: bool = True) -> Callable[[], Any]:
    """``head_to_seq`` started: returns the wait that gives its result.
    x must not change until then."""
    check_wire(wire, x)
    xp = namespace(x)
    size = comm.size
    b, s, local, d = x.shape
    heads = local * size if heads is None else heads
    owned = _owned(heads, size, num_heads)
    if local != len(owned[comm.rank]):
        raise ValueError(f"rank {comm.rank} holds {local} heads; seq_to_head of {heads} heads "
                         f"over {size} ranks gives it {len(owned[comm.rank])}")
    width = max(len(mine) for mine in owned)
    # send: sequence chunk p to rank p: [P, b, s/P, width, d]
    send = contiguous(xp.permute_dims(xp.reshape(_padded(x, width), (b, size, s // size, width, d)),
                                      (1, 0, 2, 3, 4)))
    arrived = relay(comm, [send], wire, False, asynchronous)

    def wait() -> Any:
        (received,) = arrived()  # [P (source = head owner), b, s/P, width, d]
        held = xp.concat([received[p, :, :, :len(mine)] for p, mine in enumerate(owned)], axis=2)
        copies = np.bincount(np.concatenate(owned), minlength=heads)
        if (copies == 1).all():
            return held
        # a kv head's copies are adjacent: the ranks' heads ascend
        starts = np.cumsum(copies) - copies
        return xp.stack([xp.sum(held[:, :, a:a + n], axis=2) for a, n in zip(starts, copies)],
                        axis=2)
    return wait


def lse_to_heads(lse: Any, comm) -> Any:
    """[b, h, s/P] -> [b, h_p, s]: seq_to_head of the log-sum-exp, whose head
    axis comes before the sequence."""
    xp = namespace(lse)
    moved = seq_to_head(xp.permute_dims(lse, (0, 2, 1))[..., None], comm, lse.shape[1])
    return contiguous(xp.permute_dims(moved[..., 0], (0, 2, 1)))


def lse_to_seq(lse: Any, comm, heads: int) -> Any:
    """[b, h_p, s] -> [b, h, s/P] for ``heads`` = h: the inverse of lse_to_heads."""
    xp = namespace(lse)
    moved = head_to_seq(xp.permute_dims(lse, (0, 2, 1))[..., None], comm, heads, heads)
    return contiguous(xp.permute_dims(moved[..., 0], (0, 2, 1)))
