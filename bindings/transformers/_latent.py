"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-lite,
LongCat-Flash) with the latent moved, not the heads.

transformers' MLA layers compute each token's latent (``kv_nope`` [b, 1, s,
r], normed) and shared rotary key (``k_rot`` [b, 1, s, d_rope]) and hand
them to ``self.expand_kv``, which up-projects them by ``kv_b_proj`` into K
and V of every head, right before the attention call. On a layer
``shard_batch`` checked, commlib's ``expand_kv`` keeps the two for the
attention function instead, and gives it zero-stride stand-ins of the
expanded shapes (no memory, no compute); the ring implementations then run
``latent_ring_attention`` on the latent (its method "auto": the latent
travels between hosts; on one host each rank expands its own shard), with
W_UK and W_UV read as views of ``kv_b_proj.weight`` (its gradient flows
through them). Ulysses and the
hybrid split the heads, so they need them expanded: under those the
layer expands as transformers does, and says so in a warning that names
the bytes each way."""

from __future__ import annotations

import types
import warnings
import weakref
from typing import Optional, Tuple

import torch
from torch import nn

__all__ = ["is_latent_attention", "install", "take", "expanded", "up_projections",
           "LATENT_IMPLEMENTATIONS", "sparse_indexer_problem"]

# the implementations that move the latent: the ring's (K and V are whole heads to Ulysses)
LATENT_IMPLEMENTATIONS = ("commlib_ring", "commlib_ring_docs")
# the ones that split heads, and so move them expanded
EXPANDING_IMPLEMENTATIONS = ("commlib_ulysses", "commlib_hybrid")
# the attention implementation a generate call runs under (``_generation_attention``):
# it caches the latent and expands where it must
GENERATION = "commlib_generate"

_kept: "weakref.WeakKeyDictionary[nn.Module, Tuple[torch.Tensor, torch.Tensor]]" = \
    weakref.WeakKeyDictionary()


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers MLA layer: an ``expand_kv`` of
    its class over a ``kv_b_proj`` up-projection (bias-free)."""
    projection = getattr(module, "kv_b_proj", None)
    return (callable(getattr(type(module), "expand_kv", None))
            and isinstance(projection, nn.Linear) and projection.bias is None
            and all(hasattr(module, name) for name in ("kv_lora_rank", "qk_nope_head_dim",
                                                         "qk_rope_head_dim", "v_head_dim")))


def sparse_indexer_problem(model: nn.Module) -> Optional[ValueError]:
    """DeepSeek-V3.2's sparse attention, refused by name: its indexer scores
    every key of the whole sequence for each query and keeps the top k,
    a choice no rank can make from its shard."""
    for name, module in model.named_modules():
        if is_latent_attention(module) and isinstance(getattr(module, "indexer", None),
                                                      nn.Module):
            return ValueError(
                f"{name} ({type(module).__name__}): DeepSeek sparse attention's indexer picks "
                f"each query's top-k keys across the whole sequence, which no rank sees from "
                f"its shard; commlib does not shard it. Run this model on one rank per "
                f"sequence, or a dense-attention MLA model (DeepSeek-V3) with commlib")
    return None


def install(module: nn.Module) -> None:
    """Give the MLA layer ``module`` commlib's ``expand_kv`` (once)."""
    if is_latent_attention(module) and "expand_kv" not in module.__dict__:
        module.expand_kv = types.MethodType(_expand_or_keep, module)


def _expand_or_keep(module: nn.Module, kv_nope: torch.Tensor,
                    k_rot: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' expansion, or, under a latent implementation, the
    latent kept for the attention call that follows and zero-stride
    stand-ins of K's and V's shapes."""
    implementation = getattr(module.config, "_attn_implementation", None)
    if implementation not in LATENT_IMPLEMENTATIONS + (GENERATION,):
        if implementation in EXPANDING_IMPLEMENTATIONS:
            _say_expanded(module, implementation)
        return type(module).expand_kv(module, kv_nope, k_rot)
    _kept[module] = (kv_nope, k_rot)
    b, _, s, _ = kv_nope.shape
    heads = module.kv_b_proj.out_features // (module.qk_nope_head_dim + module.v_head_dim)
    zero = kv_nope.new_zeros(())
    return (zero.expand(b, heads, s, module.qk_nope_head_dim + module.qk_rope_head_dim),
            zero.expand(b, heads, s, module.v_head_dim))


def expanded(module: nn.Module, latent: torch.Tensor, rope_k: torch.Tensor,
             implementation: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """K [b, s, h, d_nope + d_rope] and V [b, s, h, d_v] of ``take``'s
    latent, as transformers' ``expand_kv`` makes them, for
    ``implementation`` (one that splits heads), after the warning that
    says so."""
    _say_expanded(module, implementation)
    k, v = type(module).expand_kv(module, latent[:, None], rope_k[:, None])
    return k.transpose(1, 2), v.transpose(1, 2)


def _say_expanded(module: nn.Module, implementation: str) -> None:
    """The warning that this MLA layer moves expanded heads (once a place)."""
    heads = module.kv_b_proj.out_features // (module.qk_nope_head_dim + module.v_head_dim)
    expanded = heads * (module.qk_nope_head_dim + module.qk_rope_head_dim + module.v_head_dim)
    latent = module.kv_lora_rank + module.qk_rope_head_dim
    warnings.warn(f"{type(module).__name__}: {implementation} splits the heads, so this "
                  f"multi-head latent attention layer moves them expanded, {expanded} values a "
                  f"token; commlib_ring moves its latent between hosts, {latent} "
                  f"({expanded / latent:.0f}x fewer bytes)", stacklevel=3)


def take(module: nn.Module, key: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The (latent [b, s, r], rope_k [b, s, d_rope]) ``module``'s
    ``expand_kv`` kept for this call with ``key``, or None (it expanded); a
    stand-in ``key`` with nothing kept (the layer's forward is not
    transformers' order of expansion then attention) is an error, never
    attention over zeros."""
    kept = _kept.pop(module, None)
    if kept is None:
        if key.numel() and not any(key.stride()):
            raise RuntimeError(f"{type(module).__name__}: commlib's expand_kv gave this "
                               f"attention call stand-ins for K and V, but kept no latent for "
                               f"it: the layer's forward does not call expand_kv right before "
                               f"its attention; report it with the model's class")
        return None
    kv_nope, k_rot = kept
    return kv_nope[:, 0], k_rot[:, 0]


def up_projections(module: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [r, h, d_nope], W_UV [r, h, d_v]): views of ``kv_b_proj.weight``
    [h (d_nope + d_v), r], as ``expand_kv`` splits its output."""
    nope, value = module.qk_nope_head_dim, module.v_head_dim
    weight = module.kv_b_proj.weight
    per_head = weight.view(-1, nope + value, weight.shape[1])
    return per_head[:, :nope].permute(2, 0, 1), per_head[:, nope:].permute(2, 0, 1)
