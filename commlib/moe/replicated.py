"""MoE over tokens every rank holds: decode under context parallelism,
where the new token's hidden state is the same on every rank.

Dispatching every rank's copy would send each token P times and run each
expert on it P times. Instead rank r takes the tokens r, r + P, r + 2P, ...
(its share), dispatches and combines only those, and one all-gather of the
combined rows gives every rank every token's result: each token is
dispatched once. A ``Dispatcher`` with ``max_tokens_per_rank`` of
``share_size(T, P)`` makes that the fixed-capacity, sync-free exchange
(DeepEP's low-latency mode), the decode path.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

from ..namespace import device, namespace

__all__ = ["share_size", "my_share", "everyones", "replicated_moe"]


def share_size(tokens: int, size: int) -> int:
    """The most tokens any rank's share holds: ceil(T / P)."""
    return -(-tokens // size)


def my_share(x: Any, comm) -> Any:
    """This rank's share of tokens every rank holds, along axis 0: rows
    rank, rank + P, rank + 2P, ..."""
    return x[comm.rank::comm.size]


def everyones(y: Any, comm, tokens: int) -> Any:
    """Every rank's share (``y``, this rank's, [rows, ...]) put back in
    token order [tokens, ...], on every rank: one all-gather of the shares
    padded to ``share_size``."""
    xp = namespace(y)
    longest = share_size(tokens, comm.size)
    if y.shape[0] < longest:
        pad = xp.zeros((longest - y.shape[0],) + tuple(y.shape[1:]), dtype=y.dtype,
                       device=device(y))
        y = xp.concat([y, pad], axis=0)
    gathered = xp.reshape(comm.allgather(y), (comm.size, longest) + tuple(y.shape[1:]))
    interleaved = xp.reshape(xp.permute_dims(gathered, (1, 0) + tuple(range(2, y.ndim + 1))),
                             (comm.size * longest,) + tuple(y.shape[1:]))
    return interleaved[:tokens]


def replicated_moe(dispatcher, x: Any, experts: Any, weights: Any,
                   run: Callable[[Any, Any], Any]) -> Any:
    """MoE of tokens every rank holds (the same ``x`` [T, H], ``experts``
    and ``weights`` [T, k] everywhere): this rank's share dispatched through
    ``dispatcher``, its experts run by ``run(expert_x, handle)`` (expert_y
    shaped like expert_x), combined, and every share gathered: y [T, H] on
    every rank, each token dispatched once."""
    comm = dispatcher.comm
    shares: Tuple[Any, ...] = tuple(my_share(a, comm) for a in (x, experts, weights))
    expert_x, handle = dispatcher.dispatch(*shares)
    return everyones(dispatcher.combine(run(expert_x, handle), handle), comm, x.shape[0])
