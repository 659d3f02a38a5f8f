"""Ring, Ulysses and hybrid attention as transformers attention implementations.

transformers calls an attention implementation once per layer with this
rank's shard of the sequence: query [b, h, s_local, d], key and value
[b, kv_heads, s_local, d]. Each implementation here hands them to the
differentiable functions of ``commlib.bindings.torch``, which attend over the
whole (sharded) sequence. The mask functions registered under the same names
build no mask: commlib applies the causal mask itself, on global positions;
a [s_local, s_local] mask built from the local shard would be wrong.

Anything that would change the attention's math and that commlib does not
implement (attention sinks, soft-capping, sliding windows, dropout, padding)
is refused by name, on every rank, rather than silently dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from commlib import hybrid
from commlib.hybrid.attention import check_degree
from commlib.ulysses.relayout import check_heads, kv_heads_for

from .torch import hybrid_attention, ring_attention, ulysses_attention

__all__ = ["register_attention", "LAYOUTS"]

# the sequence layout each implementation expects (shard_batch's ``layout``)
LAYOUTS = {"commlib_ring": "zigzag", "commlib_ulysses": "contiguous",
           "commlib_hybrid": "contiguous"}

# Keyword arguments transformers passes down to every attention call that do
# not change the attention's math: the batch's own bookkeeping (the loss
# inputs travel through the model's **kwargs) and output switches.
BOOKKEEPING = frozenset({"position_ids", "use_cache", "num_items_in_batch", "shift_labels",
                         "output_hidden_states", "output_router_logits"})

# Keyword arguments that change the math, accepted only unset (None or False).
UNSUPPORTED = {
    "s_aux": "attention sinks",
    "softcap": "logit soft-capping",
    "position_bias": "an additive position bias",
    "head_mask": "a head mask",
    "output_attentions": "returning attention weights",
    "cu_seq_lens_q": "packed sequences (a later commlib issue)",
    "cu_seq_lens_k": "packed sequences (a later commlib issue)",
    "max_length_q": "packed sequences (a later commlib issue)",
    "max_length_k": "packed sequences (a later commlib issue)",
    "seq_idx": "packed sequences (a later commlib issue)",
}

# attend(q, k, v, causal, softmax_scale) on [b, s_local, h, d] shards
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, Optional[float]],
                  torch.Tensor]


def register_attention(comm, ulysses_size: Optional[int] = None) -> None:
    """Register ``"commlib_ring"`` (zigzag layout), ``"commlib_ulysses"`` and
    ``"commlib_hybrid"`` (contiguous layout) over ``comm`` in transformers'
    ``AttentionInterface``, with mask functions of the same names in
    ``AttentionMaskInterface``. ``ulysses_size``: the hybrid's Ulysses degree
    (default: ``commlib.hybrid.plan``'s choice for each shape). A later call
    replaces the communicator."""
    if ulysses_size is not None:
        check_degree(comm.size, ulysses_size)
    implementations: Dict[str, Attend] = {
        "commlib_ring": lambda q, k, v, causal, scale: ring_attention(
            q, k, v, comm, causal, layout=LAYOUTS["commlib_ring"], softmax_scale=scale),
        "commlib_ulysses": _ulysses(comm),
        "commlib_hybrid": _hybrid(comm, ulysses_size),
    }
    for name, attend in implementations.items():
        AttentionInterface.register(name, _attention_function(name, attend, comm.size))
        AttentionMaskInterface.register(name, _mask_function(name, comm))


def _ulysses(comm) -> Attend:
    def attend(q, k, v, causal, scale):
        _check_ulysses_heads("commlib_ulysses", q.shape[2], k.shape[2], comm.size)
        return ulysses_attention(q, k, v, comm, causal, softmax_scale=scale)
    return attend


def _hybrid(comm, ulysses_size: Optional[int]) -> Attend:
    """The hybrid at ``ulysses_size``, or at the degree the planner picks
    for each shape (planned once per shape: the first plan probes the fabric,
    a collective every rank reaches at the same layer)."""
    planned: Dict[Tuple[Any, ...], int] = {}

    def attend(q, k, v, causal, scale):
        (_, s_local, heads, head_dim), kv_heads = q.shape, k.shape[2]
        degree = ulysses_size
        if degree is None:
            shape = (s_local, heads, kv_heads, head_dim, q.element_size(), causal)
            if shape not in planned:
                planned[shape] = hybrid.plan(comm, s_local * comm.size, heads, kv_heads,
                                             head_dim, q.element_size(), causal).ulysses_size
            degree = planned[shape]
        _check_ulysses_heads("commlib_hybrid", heads, kv_heads, degree)
        return hybrid_attention(q, k, v, comm, degree, causal, softmax_scale=scale)
    return attend


def _check_ulysses_heads(name: str, heads: int, kv_heads: int, degree: int) -> None:
    """Ulysses splits the heads over its degree: the model's head counts must
    allow it (decided from the config, so every rank raises alike)."""
    try:
        check_heads(heads, degree)
        kv_heads_for(0, kv_heads, degree)
    except ValueError as error:
        raise ValueError(f"{name}: Ulysses splits the attention heads ({heads}) and kv heads "
                         f"({kv_heads}) over its degree ({degree}): {error}. commlib_ring "
                         f"works with any head count; commlib_hybrid takes a smaller "
                         f"ulysses_size") from None


def _attention_function(name: str, attend: Attend, world_size: int) -> Callable:
    """The function transformers calls: checks the call, moves the heads
    axis where commlib wants it ([b, s, h, d]), attends."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
        global_length = query.shape[2] * world_size
        _check_call(name, attention_mask, dropout, sliding_window, global_length, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        out = attend(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                     causal, scaling)
        return out, None

    attention.__name__ = attention.__qualname__ = name
    return attention


def _check_call(name: str, attention_mask: Optional[torch.Tensor], dropout: float,
                sliding_window: Optional[int], global_length: int,
                kwargs: Dict[str, Any]) -> None:
    """Refuse, by name, what the attention would otherwise get wrong. Every
    check reads the model's config and the shapes, the same on every rank."""
    if attention_mask is not None:
        raise ValueError(
            f"{name} got an attention mask of shape {tuple(attention_mask.shape)}; commlib "
            f"applies the causal mask itself on the global sequence and takes no mask. "
            f"Padding and packed sequences are a later commlib issue: pass full, unpadded "
            f"sequences (shard_batch makes them)")
    if dropout:
        raise ValueError(f"{name} does not implement attention dropout (dropout={dropout}); "
                         f"set the model's config.attention_dropout = 0.0")
    if sliding_window is not None and sliding_window < global_length:
        raise ValueError(f"{name} does not implement sliding-window attention "
                         f"(sliding_window={sliding_window} < the sequence's "
                         f"{global_length} tokens)")
    unknown = sorted(set(kwargs) - BOOKKEEPING - set(UNSUPPORTED))
    if unknown:
        raise ValueError(f"{name} got keyword argument(s) {', '.join(unknown)} that it does not "
                         f"know; they may change the attention's math, so it refuses them "
                         f"rather than ignore them")
    for key, what in UNSUPPORTED.items():
        if kwargs.get(key) is not None and kwargs[key] is not False:
            raise ValueError(f"{name} does not implement {what} ({key}= was given)")


def _mask_function(name: str, comm) -> Callable:
    """transformers' mask hook for ``name``: no mask (commlib applies the
    causal mask), after refusing what no mask can express: padding, or a
    sliding or chunked window shorter than the sequence."""

    def no_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                kv_offset: int = 0, mask_function: Optional[Callable] = None,
                attention_mask: Optional[torch.Tensor] = None,
                local_size: Optional[int] = None, **kwargs: Any) -> None:
        if local_size is not None and local_size < q_length * comm.size:
            raise ValueError(f"{name} does not implement sliding-window or chunked attention "
                             f"(a window of {local_size} < the sequence's "
                             f"{q_length * comm.size} tokens)")
        if attention_mask is not None:  # its values differ per rank: decide together
            padded = not bool(attention_mask.all())
            comm.agree(f"{name} attention mask", problem=ValueError(
                f"{name}: the attention mask pads this rank's tokens; padding is a later "
                f"commlib issue: pass full, unpadded sequences") if padded else None)
        return None

    no_mask.__name__ = no_mask.__qualname__ = f"{name}_mask"
    return no_mask
