"""A KV cache sharded over the ranks by position: every rank holds about
1/P of the positions of every layer's K and V, and nothing else.

Layout. A prefill leaves each rank the positions of its shard (the tokens
its prefill attention held: ``zigzag``, ``contiguous``, ... as
``commlib.sequence.documents`` lays them out, padding dropped). Every later token is
striped by position: the token at position p goes to rank ``p % P``
(SGLang's decode context parallelism). Striping needs no state to agree on
(the owner is a function of the position alone), keeps the shards within
one token of each other past the prefill, spreads a chunk of t new tokens
over min(t, P) ranks, and adding a token touches one rank's cache.

Within a rank the positions increase: a prefill shard's chunks come in
sequence order, and every later token is past all of them. So the keys a
query sees (causal, or inside a window) are one index range of the shard
(``commlib.sequence.visibility.band_blocks``).

Storage: per layer, K and V [batch, capacity, kv_heads, head_dim] (V's head
size may differ) in the framework, device and dtype of the first K/V
stored, grown by doubling (so adding a token is amortised O(1));
``keys(layer)`` / ``values(layer)`` are views of the filled part. A layer
stored without V keeps K alone: multi-head latent attention's cache, whose
"key" is each token's latent and rotary key and whose value is a part of
it (``commlib.inference.latent``). JAX arrays are immutable: each write makes a new
array.
"""

from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import array_api_extra as xpx
import numpy as np

from ..namespace import device, namespace

__all__ = ["ShardedKVCache", "striped"]


def striped(positions: Sequence[int], size: int, rank: int) -> np.ndarray:
    """Which of ``positions`` (new tokens, past the prefill) rank keeps:
    their indices, where ``position % size == rank``."""
    return np.flatnonzero(np.asarray(positions, np.int64) % size == rank)


class ShardedKVCache:
    """This rank's shard of a KV cache of ``num_layers`` layers, over a
    world of ``size`` ranks (``rank`` is this one).

    A step adds tokens in two moves: ``admit(positions, rows)`` says which
    of the step's new tokens this rank keeps (``rows``: their indices along
    the step's sequence axis; ``positions``: their global positions, past
    every cached one), then each layer's ``store(layer, k, v)`` keeps those
    rows of that layer's new K and V and returns the layer's whole shard."""

    def __init__(self, num_layers: int, size: int, rank: int):
        if num_layers < 1:
            raise ValueError(f"a KV cache needs at least one layer, got {num_layers}")
        self.num_layers, self.size, self.rank = num_layers, size, rank
        self.positions = np.zeros(0, np.int64)   # this rank's, increasing
        self.length = 0                          # tokens cached over all ranks
        self.prefill: Optional[Tuple[str, int]] = None  # (layout, tokens) of the first prefill
        self.history: Optional[int] = None      # a fingerprint of the cached tokens' ids
        self._rows = np.zeros(0, np.int64)       # rows of this step's new K/V to keep
        self._keys: List[Any] = [None] * num_layers
        self._values: List[Any] = [None] * num_layers
        self._keys_only: List[Optional[bool]] = [None] * num_layers  # set by the first store
        self._filled = [0] * num_layers

    # -- steps ----------------------------------------------------------------
    def admit(self, positions: Sequence[int], rows: Sequence[int], length: int) -> None:
        """This step keeps the new tokens at ``rows`` of its K/V, at global
        ``positions`` (increasing, past every cached position); afterwards
        ``length`` tokens are cached over all ranks. Every layer must then
        ``store`` once."""
        positions = np.asarray(positions, np.int64)
        if self.positions.size and positions.size and positions[0] <= self.positions[-1]:
            raise ValueError(f"new positions must come after the cached ones (the last here is "
                             f"{int(self.positions[-1])}), got {positions[:4].tolist()}...")
        if np.any(np.diff(positions) <= 0):
            raise ValueError("a step's positions must increase")
        self.positions = np.concatenate([self.positions, positions])
        self._rows = np.asarray(rows, np.int64)
        self.length = length

    def store(self, layer: int, k: Any, v: Optional[Any]) -> Tuple[Any, Optional[Any]]:
        """Keep this step's admitted rows of ``k`` and ``v`` [b, t, hk, d]
        in ``layer`` (``v`` None: K alone, every step of the layer); returns
        the layer's whole shard (keys, values or None)."""
        xp = namespace(k)
        count = int(self._rows.size)
        if self._keys_only[layer] not in (None, v is None):
            raise ValueError(f"layer {layer} of the KV cache keeps "
                             f"{'K alone' if v is not None else 'K and V'}: store it alike at "
                             f"every step")
        self._keys_only[layer] = v is None
        if self._filled[layer] + count != self.positions.size:
            raise ValueError(f"layer {layer} of the KV cache stored "
                             f"{self._filled[layer]} tokens before this step, which adds "
                             f"{count}, but {self.positions.size} are admitted: each layer "
                             f"stores once per admitted step")
        if count:
            index = xp.asarray(self._rows, device=device(k)) \
                if count < k.shape[1] else None
            new_k = k if index is None else xp.take(k, index, axis=1)
            new_v = v if index is None or v is None else xp.take(v, index, axis=1)
            self._grow(layer, new_k, new_v, self._filled[layer] + count)
            start, stop = self._filled[layer], self._filled[layer] + count
            self._keys[layer] = xpx.at(self._keys[layer])[:, start:stop].set(new_k)
            if v is not None:
                self._values[layer] = xpx.at(self._values[layer])[:, start:stop].set(new_v)
            self._filled[layer] = stop
        values = None if v is None else self.values(layer, like=v)
        return self.keys(layer, like=k), values

    def _grow(self, layer: int, k: Any, v: Optional[Any], needed: int) -> None:
        """Capacity for ``needed`` tokens in ``layer``: doubled when short
        (K and V each in its own head size)."""
        held = self._keys[layer]
        capacity = 0 if held is None else held.shape[1]
        if needed <= capacity:
            return
        length = max(needed, 2 * capacity)
        self._keys[layer] = self._grown(held, k, length, layer)
        if v is not None:
            self._values[layer] = self._grown(self._values[layer], v, length, layer)

    def _grown(self, held: Optional[Any], like: Any, length: int, layer: int) -> Any:
        """A buffer of ``length`` tokens shaped as ``like``, holding ``held``'s
        filled part."""
        xp = namespace(like)
        fresh = xp.zeros((like.shape[0], length) + tuple(like.shape[2:]), dtype=like.dtype,
                         device=device(like))
        if held is None:
            return fresh
        filled = self._filled[layer]
        return xpx.at(fresh)[:, :filled].set(held[:, :filled])

    # -- reading --------------------------------------------------------------
    def keys(self, layer: int, like: Any = None) -> Any:
        """This rank's keys of ``layer`` [b, n, hk, d] (n = its positions)."""
        return self._filled_part(self._keys[layer], layer, like)

    def values(self, layer: int, like: Any = None) -> Any:
        """This rank's values of ``layer`` [b, n, hk, d_v]; None for a layer
        that keeps K alone."""
        if self._keys_only[layer]:
            return None
        return self._filled_part(self._values[layer], layer, like)

    def _filled_part(self, held: Any, layer: int, like: Any) -> Any:
        if held is None:
            if like is None:
                raise ValueError(f"layer {layer} of the KV cache holds nothing yet")
            xp = namespace(like)
            return xp.zeros((like.shape[0], 0) + tuple(like.shape[2:]), dtype=like.dtype,
                            device=device(like))
        return held[:, :self._filled[layer]]

    @property
    def tokens(self) -> int:
        """Tokens this rank holds (of ``length`` over all ranks)."""
        return int(self.positions.size)

    def nbytes(self) -> int:
        """Bytes of K and V this rank holds (the filled part)."""
        return sum(self._filled[layer] * held.shape[0] * math.prod(held.shape[2:])
                   * held.dtype.itemsize
                   for layer in range(self.num_layers)
                   for held in (self._keys[layer], self._values[layer]) if held is not None)

    def digest(self) -> str:
        """What every rank's cache must share (the world, the prefill, the
        length), for ``Communicator.agree``."""
        return (f"size={self.size} layers={self.num_layers} prefill={self.prefill} "
                f"length={self.length}")

    def problem(self, size: int, rank: int) -> Optional[ValueError]:
        """Why this cache cannot serve rank ``rank`` of a world of ``size``
        (None: it can)."""
        if (self.size, self.rank) != (size, rank):
            return ValueError(f"this KV cache is rank {self.rank}'s shard of a world of "
                              f"{self.size}, not rank {rank}'s of {size}: a sharded cache "
                              f"continues only on the world that made it")
        return None
