"""Where the recurrent mixers of a ``recurrent_parallel`` model keep their
states inside commlib's ``generate``.

``generate`` runs the model without transformers' cache (its attention
keeps K and V in a ``ShardedKVCache``). The recurrent mixers keep theirs in
a transformers ``DynamicCache`` of the model's config (``recurrent_states``),
which ``generate`` hands them for each forward (``generation_states``):

- the sharded prefill (``layout=`` the prefill's): each mixer runs on its shard as in
  training and leaves in the cache what decode reads, alike on every rank:
  the scan's final state (the global prompt's, already on every rank; LFM2's
  short convolution has none) and
  the convolution's state, the last ``kernel`` input tokens of the global
  prompt (``keep_states``: gathered from the ranks that hold them);
- replicated tokens (decode, a later turn's new tokens): the mixer's own
  forward runs on the cache, as in ``model.generate``.

Both transformers 5.17 and 5.25 keep a layer's states through the same
``Cache.update_conv_state`` / ``update_recurrent_state``, which are what
this writes through (the conv state: the last ``kernel`` tokens, zeros
before the sequence's start).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch
from transformers import DynamicCache

from commlib.recurrent.pieces import sharding

__all__ = ["recurrent_states", "generation_states", "replicated_states", "prefill", "keep_states"]


@dataclass(frozen=True)
class _Generation:
    states: Any             # the transformers Cache holding every recurrent layer's states
    layout: Optional[str]   # this forward's tokens are this rank's shard in it (None: alike)


_ACTIVE: contextvars.ContextVar[Optional[_Generation]] = contextvars.ContextVar(
    "commlib_recurrent_generation", default=None)


def recurrent_states(config: Any) -> Any:
    """An empty cache for the recurrent layers of the model of ``config``."""
    return DynamicCache(config=config)


@contextlib.contextmanager
def generation_states(states: Any, *, layout: Optional[str]) -> Iterator[None]:
    """The model's recurrent mixers read and write ``states`` for the
    forwards inside: on this rank's shard of the sequence in ``layout``
    (generate's attention is none of commlib's layouts), or, ``layout``
    None, on tokens every rank runs alike."""
    token = _ACTIVE.set(_Generation(states, layout))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def replicated_states() -> Optional[Any]:
    """The cache a mixer's own forward runs on (replicated tokens inside
    generate), else None."""
    active = _ACTIVE.get()
    return None if active is None or active.layout is not None else active.states


def prefill() -> Optional[Tuple[Any, str]]:
    """Inside a sharded prefill: (the cache it leaves its states in, the
    shard's layout); else None."""
    active = _ACTIVE.get()
    return None if active is None or active.layout is None else (active.states, active.layout)


def keep_states(states: Any, layer_idx: int, final_state: Optional[torch.Tensor],
                conv_input: torch.Tensor, kernel: int, comm, layout: str,
                cu_seqlens: Optional[List[int]]) -> None:
    """Layer ``layer_idx``'s states in ``states``: the scan's ``final_state``
    (the global sequence's, the same on every rank; None for a layer with no
    scan, LFM2's short convolution) and the conv state, the
    last ``kernel`` tokens of the global sequence's last document, of which
    this rank's shard ``conv_input`` [batch, length, channels] holds some.
    Each rank puts the ones it holds in place, zeros elsewhere; an
    all-gather and a sum over ranks (each position from one rank, exact)
    gives every rank all of them."""
    held = sharding(comm, conv_input.shape[1], layout=layout, cu_seqlens=cu_seqlens)
    end = max(piece.origin + piece.length for pieces in held.real for piece in pieces)
    first = max(end - kernel, 0 if cu_seqlens is None else cu_seqlens[-2])
    tail = conv_input.new_zeros(conv_input.shape[0], kernel, conv_input.shape[2])
    for piece in held.real[comm.rank]:
        start, stop = max(piece.origin, first), piece.origin + piece.length
        if start < stop:
            tail[:, start - end + kernel:stop - end + kernel] = \
                conv_input[:, piece.start + start - piece.origin:piece.stop]
    tail = comm.allgather(tail[None].contiguous(), axis=0).sum(0)
    states.update_conv_state(tail.transpose(1, 2), layer_idx, conv_kernel_size=kernel)
    if final_state is not None:
        states.update_recurrent_state(final_state, layer_idx)
