"""The attention implementation a ``generate`` call runs its model under
(``"commlib_generate"``), what it reads of the current forward, and the
compiled decode step."""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface

from commlib.inference import (
    ShardedKVCache,
    chunk_attention,
    decode_attention,
    latent_chunk_attention,
    latent_decode_attention,
    latent_keys,
)

from ..torch import DecodeCache, latent_ring_attention
from ._attention import (
    LAYOUTS,
    SINKS,
    SOFTCAP,
    check_call,
    implementations,
    mask_function,
    window_of,
)
from ._experts import IMPLEMENTATION as EXPERTS
from ._experts import replicated_tokens
from ._latent import GENERATION, LATENT_IMPLEMENTATIONS, expanded, take, up_projections
from ._recurrent_generation import generation_states

# who made an attention call: the module's class and layer_idx
Caller = Tuple[str, Optional[int]]


@dataclass
class ForwardStep:
    """What the model's current forward is, for the attention: its tokens'
    positions (this rank's, or everyone's when ``replicated``), the cache
    they go to (None in the first prefill, whose K and V are ``kept`` for
    the cache made after it, a layer per call), and for the first prefill
    the documents' offsets."""

    cache: Optional[ShardedKVCache]
    positions: np.ndarray
    replicated: bool
    offsets: Optional[List[int]] = None   # the first prefill's cu_seqlens
    layout: Optional[str] = None          # and its layout
    method: str = "auto"                  # a chunk's pass-Q or pass-KV
    states: Any = None                    # a hybrid model's recurrent states (a transformers Cache)
    calls: List[Caller] = field(default_factory=list)  # this forward's attention calls so far
    kept: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = field(default_factory=list)

    def slot(self, module: torch.nn.Module) -> int:
        """The cache layer of this attention call: its place among the
        forward's calls, which must be those of the first prefill's forward
        (the same modules in the same order: each keeps its K and V in its
        own layer)."""
        slot, caller = len(self.calls), caller_of(module)
        self.calls.append(caller)
        callers = [] if self.cache is None else self.cache.callers
        if self.cache is not None and (slot >= len(callers) or callers[slot] != caller):
            made = describe_caller(callers[slot]) if slot < len(callers) else "no such call"
            raise ValueError(f"{describe_caller(caller)} makes attention call {slot} of this "
                             f"forward, where the first prefill's forward had {made}: "
                             f"commlib's generate keeps each call's K and V by its place among "
                             f"the forward's attention calls, so every forward must make the "
                             f"same calls in the same order")
        return slot

    def check_calls(self) -> None:
        """After the forward: it made every call the cache has a layer for."""
        if self.cache is not None and len(self.calls) != len(self.cache.callers):
            raise ValueError(f"this forward made {len(self.calls)} attention calls, the first "
                             f"prefill's {len(self.cache.callers)}: commlib's generate keeps "
                             f"a cache layer per call, so every forward must make the same "
                             f"calls")


def caller_of(module: torch.nn.Module) -> Caller:
    return type(module).__name__, getattr(module, "layer_idx", None)


def describe_caller(caller: Caller) -> str:
    kind, layer = caller
    return kind if layer is None else f"{kind} (layer {layer})"


_ACTIVE: contextvars.ContextVar[Optional[ForwardStep]] = contextvars.ContextVar(
    "commlib_generate", default=None)


@dataclass
class _Decoding:
    """The compiled decode step's state, read by the attention of this
    call (a plain attribute: ``torch.compile`` does not trace a ContextVar):
    the cache and the step's positions [1] on the device; None outside it."""

    cache: Optional[DecodeCache] = None
    positions: Optional[torch.Tensor] = None


@contextlib.contextmanager
def generation_attention(model: torch.nn.Module, comm, name: str) -> Iterator[_Decoding]:
    """The model switched to ``"commlib_generate"`` over ``comm`` (the first
    prefill by ``name``), and back afterwards."""
    attend = implementations(comm)[name]
    decoding = _Decoding()
    AttentionInterface.register(GENERATION, _attention(name, attend, comm, decoding))
    AttentionMaskInterface.register(GENERATION, mask_function(GENERATION, comm))
    previous = model.config._attn_implementation
    model.set_attn_implementation(GENERATION)
    try:
        yield decoding
    finally:
        model.set_attn_implementation(previous)


def _attention(name: str, attend: Callable, comm, decoding: _Decoding) -> Callable:
    """The attention transformers calls per layer during generate: keep the
    step's K and V in the cache (in the first prefill, for the cache made
    after it), then attend: the first prefill's sharded attention (``name``'s
    ``attend``), a chunk against the cache, or replicated tokens over it. A
    multi-head latent attention layer keeps its latent instead
    (``_latent_attention``)."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if decoding.cache is not None:
            return _decode_attention(decoding, module, query, key, value, attention_mask,
                                     dropout, scaling, is_causal, sliding_window, kwargs), None
        step = _ACTIVE.get()
        if step is None:
            raise RuntimeError(f"{GENERATION!r} attends only inside "
                               f"commlib.bindings.transformers.generate")
        kwargs.pop("position_ids", None)
        check_call(GENERATION, module, attention_mask, dropout, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        length = step.offsets[-1] if step.cache is None else step.cache.length
        window = window_of(GENERATION, sliding_window, length, causal)
        latent = take(module, key)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        slot = step.slot(module)
        settings = dict(causal=causal, window=window, softmax_scale=scaling,
                        sinks=kwargs.get(SINKS), softcap=kwargs.get(SOFTCAP))
        if latent is not None:
            return _latent_attention(module, q, latent, step, slot, name, attend, comm,
                                     settings), None
        if step.cache is None:
            step.kept.append((k, v))
            return attend(q, k, v, cu_seqlens=step.offsets, **settings), None
        keys, values = step.cache.store(slot, k, v)
        if step.replicated:
            out = decode_attention(q, keys, values, comm, q_positions=step.positions,
                                   k_positions=step.cache.positions, **settings)
        else:
            out = chunk_attention(q, keys, values, comm, q_positions=step.positions,
                                  k_positions=step.cache.positions, method=step.method,
                                  **settings)
        return out, None

    attention.__name__ = attention.__qualname__ = GENERATION
    return attention


def _latent_attention(module: torch.nn.Module, q: torch.Tensor,
                      latent: Tuple[torch.Tensor, torch.Tensor], step: ForwardStep, slot: int,
                      name: str, attend: Callable, comm, settings: Dict[str, Any]
                      ) -> torch.Tensor:
    """A multi-head latent attention layer's call: its cache layer keeps the
    tokens' latents and rotary keys (``latent_keys``), not expanded heads.
    The first prefill runs ``latent_ring_attention`` (``name`` a ring
    implementation: the latent travels between hosts; one that splits heads
    gets them expanded), later steps attend in the absorbed form over the
    cache."""
    keys = latent_keys(*latent)
    w_uk, w_uv = up_projections(module)
    if step.cache is None:
        step.kept.append((keys, None))
        if name in LATENT_IMPLEMENTATIONS:
            return latent_ring_attention(q, *latent, w_uk, w_uv, comm, layout=LAYOUTS[name],
                                         cu_seqlens=step.offsets, **settings)
        return attend(q, *expanded(module, *latent, name), cu_seqlens=step.offsets, **settings)
    held, _ = step.cache.store(slot, keys, None)
    where = dict(q_positions=step.positions, k_positions=step.cache.positions, **settings)
    if step.replicated:
        return latent_decode_attention(q, held, w_uk, w_uv, comm, **where)
    return latent_chunk_attention(q, held, w_uk, w_uv, comm, method=step.method, **where)


def _decode_attention(decoding: _Decoding, module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float,
                      scaling: Optional[float], is_causal: Optional[bool],
                      sliding_window: Optional[int], kwargs: Dict[str, Any]) -> torch.Tensor:
    """A compiled decode step's attention: the token's K and V into the
    DecodeCache, then ``decode_attention`` over it, nothing read back. A
    window is passed whenever the model has one (one that covers the
    sequence hides nothing), so no step's settings differ."""
    kwargs.pop("position_ids", None)
    check_call(GENERATION, module, attention_mask, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = window_of(GENERATION, sliding_window, (sliding_window or 0) + 1, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    decoding.cache.store(module.layer_idx, k, v)
    return decoding.cache.attend(module.layer_idx, q, decoding.positions, causal=causal,
                                 window=window, softmax_scale=scaling, sinks=kwargs.get(SINKS),
                                 softcap=kwargs.get(SOFTCAP))


def _expert_parallel(model: torch.nn.Module) -> bool:
    return any(getattr(getattr(module, "config", None), "_experts_implementation", None)
               == EXPERTS for module in model.modules())


class CompiledDecode:
    """The model on one replicated token, compiled once for the call, over
    a DecodeCache made from the sharded cache (room for every token the
    call may add) and written back into it at the end (``finish``)."""

    def __init__(self, model, cache: ShardedKVCache, comm, decoding: _Decoding,
                 max_length: int, batch: int, device: torch.device):
        self.model, self.sharded, self.decoding = model, cache, decoding
        config = model.config
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        like = torch.empty((batch, 0, config.num_key_value_heads, head_dim), dtype=model.dtype,
                           device=device)
        room = cache.tokens + math.ceil(max(max_length - cache.length, 0) / comm.size) + 1
        decoding.cache = DecodeCache.from_sharded(cache, comm, room, like=like)
        decoding.positions = torch.zeros(1, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((batch, 1), dtype=torch.int64, device=device)
        # an expert-parallel model's experts break the graph (they read
        # whether tokens are replicated from a ContextVar, which dynamo does
        # not trace): compiled around them
        self.step = torch.compile(self._step, fullgraph=not _expert_parallel(model))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.decoding.cache.advance(positions)
        position_ids = positions[None].expand(tokens.shape[0], -1)
        return self.model(input_ids=tokens, position_ids=position_ids, use_cache=False,
                          logits_to_keep=1).logits[:, -1]

    def logits(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The last token's logits [batch, vocab] (float32) for ``tokens``
        [batch, 1] at ``position``, the same on every rank."""
        # the tensors the graph reads, their layout fixed: no retrace
        self.decoding.positions.fill_(position)
        self.tokens.copy_(tokens)
        with torch.no_grad(), replicated_tokens():
            return self.step(self.tokens, self.decoding.positions).float()

    def finish(self, length: int) -> None:
        """The decoded tokens' K and V into the sharded cache (``length``
        tokens over all ranks), and the attention back to the cache's."""
        self.decoding.cache.into(self.sharded, length)
        self.decoding.cache = self.decoding.positions = None


def forward_step(model: torch.nn.Module, step: ForwardStep, keep: torch.Tensor,
                 **inputs: Any) -> torch.Tensor:
    """The model on this step's tokens; the logits of the rows ``keep``
    (indices along the sequence) [batch, len(keep), vocab]."""
    token = _ACTIVE.set(step)
    try:
        with torch.no_grad(), (replicated_tokens() if step.replicated
                               else contextlib.nullcontext()), \
                (contextlib.nullcontext() if step.states is None
                 else generation_states(step.states, layout=step.layout)):
            logits = model(use_cache=False, logits_to_keep=keep, **inputs).logits
        step.check_calls()
        return logits
    finally:
        _ACTIVE.reset(token)
