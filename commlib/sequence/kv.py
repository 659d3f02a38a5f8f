"""K and V as the one array that travels (a ring hop, an all-gather, a
sparse exchange) and their gradients as the one array that travels back.

Where K and V have one shape they are stacked, [2, b, s, hk, d], as they
always were. Multi-head latent attention gives them different head sizes
(DeepSeek-V3: 192 for q and k, 128 for v), which cannot stack: they go side
by side on the head-size axis instead, [1, b, s, hk, dk + dv], so that
either way the sequence is axis 2 and one exchange moves exactly K's and
V's bytes, no padding."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

from ..namespace import namespace


def joined(k: Any, v: Any) -> Any:
    """``k`` [b, s, hk, dk] and ``v`` [b, s, hk, dv] as one array [n, b, s, hk, w]."""
    xp = namespace(k)
    if tuple(k.shape) == tuple(v.shape):
        return xp.stack([k, v])
    return xp.concat([k, v], axis=-1)[None]


def joined_shape(k_shape: Sequence[int], v_shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape ``joined`` gives arrays of these shapes."""
    if tuple(k_shape) == tuple(v_shape):
        return (2, *k_shape)
    return (1, *k_shape[:-1], k_shape[-1] + v_shape[-1])


def split(kv: Any, key_dim: int) -> Tuple[Any, Any]:
    """(k, v) of a ``joined`` array (views), k's head size ``key_dim``."""
    if kv.shape[0] == 2:
        return kv[0], kv[1]
    return kv[0, ..., :key_dim], kv[0, ..., key_dim:]
