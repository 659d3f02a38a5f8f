"""The processors whose Q/K/V projection the binding owns, for Ulysses
overlapped with it (``context_parallel(..., overlap_groups=n)``).

An owned processor is a routed one (``_routing.py``) whose class is swapped
once more, for a subclass whose ``__call__`` runs its model family's
attention here: the projection, the per-head norms and the rotary embedding
of one head group at a time (the rows of the Linear weights for those
heads) inside ``project(rows, heads, kv_heads)``, handed to
``ShardedAttention.overlapped`` (commlib's ``ulysses_attention_overlapped``
with the binding's padding mask), then the output projection, each step as
the processor's own code does it. Where the family's code does not apply to
a call (fused projections, a projection that is not a plain ``Linear``: a
LoRA or quantized layer, whose rows this cannot slice) it runs the routed
processor unchanged. Families:

- ``FluxAttnProcessor``: Flux's double-stream (joint: [text | image], the
  text through ``add_q/k/v_proj`` and ``norm_added_q/k``) and
  single-stream attention.

Not owned (the routed path, not overlapped): Wan's ``WanAttnProcessor``
(its ``norm_q`` / ``norm_k`` are RMS norms across every head, so no head
group can be normalized before all are projected), QwenImage's and the
other families' processors.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

from commlib.ulysses.overlap import head_groups

from ._attention import ShardedAttention

_owned: Dict[type, type] = {}


def _heads(linear: torch.nn.Linear, x: torch.Tensor, heads: slice, head_dim: int) -> torch.Tensor:
    """``linear(x)`` for the heads ``heads`` alone: [b, s, len(heads), head_dim]."""
    rows = slice(heads.start * head_dim, heads.stop * head_dim)
    bias = None if linear.bias is None else linear.bias[rows]
    return F.linear(x, linear.weight[rows], bias).unflatten(-1, (-1, head_dim))


def _flux_applies(attn: Any) -> bool:
    linears = [attn.to_q, attn.to_k, attn.to_v]
    if attn.added_kv_proj_dim is not None:
        linears += [attn.add_q_proj, attn.add_k_proj, attn.add_v_proj]
    return not attn.fused_projections and all(type(m) is torch.nn.Linear for m in linears)


def _flux(config: ShardedAttention, attn: Any, hidden_states: torch.Tensor,
          encoder_hidden_states: Optional[torch.Tensor] = None,
          attention_mask: Optional[torch.Tensor] = None,
          image_rotary_emb: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Any:
    """``FluxAttnProcessor.__call__`` (diffusers 0.42.1) with the projection per head group."""
    from diffusers.models.embeddings import apply_rotary_emb

    d = attn.head_dim

    def project(rows: slice, heads: slice, kv_heads: slice):
        x = hidden_states[rows]
        q, k, v = (_heads(m, x, heads, d) for m in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if attn.added_kv_proj_dim is not None:
            text = encoder_hidden_states[rows]
            tq, tk, tv = (_heads(m, text, heads, d)
                          for m in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1), torch.cat([tv, v], 1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        return q, k, v

    local = hidden_states.shape[1]
    if attn.added_kv_proj_dim is not None:
        local += encoder_hidden_states.shape[1]
    out = config.overlapped(project, hidden_states.shape[0], local, attn.heads, attention_mask,
                            None).flatten(2, 3)
    if encoder_hidden_states is None:
        return out
    text, image = out.split_with_sizes([encoder_hidden_states.shape[1],
                                        out.shape[1] - encoder_hidden_states.shape[1]], dim=1)
    image = attn.to_out[1](attn.to_out[0](image.contiguous()))
    return image, attn.to_add_out(text.contiguous())


def _families() -> Dict[type, Tuple[Callable[[Any], bool], Callable[..., Any]]]:
    """Each owned processor class: (whether its family's code applies to a
    module, the family's attention)."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    return {FluxAttnProcessor: (_flux_applies, _flux)}


def _original(processor: Any) -> type:
    return getattr(type(processor), "_commlib_unrouted", type(processor))


def owns(processor: Any) -> bool:
    """Whether the binding owns this processor's projection (its exact class:
    a subclass may compute otherwise)."""
    return _original(processor) in _families()


def owned_modules(model: torch.nn.Module) -> Iterator[Tuple[str, Any]]:
    """(name, attention module) of every module whose processor is owned."""
    for name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is not None and owns(processor):
            yield name, module


def check_groups(model: torch.nn.Module, groups: int, ulysses_degree: int) -> None:
    """A ValueError naming the module whose heads ``groups`` cannot cut over
    ``ulysses_degree`` ranks (``head_groups``' rules)."""
    for name, module in owned_modules(model):
        try:
            head_groups(module.heads, module.heads, groups, ulysses_degree)
        except ValueError as error:
            raise ValueError(f"overlap_groups={groups}: {type(model).__name__}.{name} "
                             f"({module.heads} heads over a Ulysses degree of "
                             f"{ulysses_degree}): {error}") from None


def owned_class(routed: type) -> type:
    """The routed class ``routed`` with ``__call__`` its family's attention
    (made once per class); its signature is the original's, which diffusers'
    attention modules read to filter their keyword arguments."""
    if routed not in _owned:
        original = routed._commlib_unrouted
        applies, family = _families()[original]
        signature = inspect.signature(original.__call__)

        @functools.wraps(original.__call__)
        def __call__(self, attn, *args, **kwargs):
            if not applies(attn):
                return routed.__call__(self, attn, *args, **kwargs)
            bound = signature.bind(self, attn, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            del arguments["self"]
            return family(self._parallel_config, **arguments)
        _owned[routed] = type(routed.__name__, (routed,), {
            "__call__": __call__, "__module__": routed.__module__,
            "_commlib_unrouted": original})
    return _owned[routed]


def own(processor: Any) -> None:
    """Swap a routed, owned processor's class for its family's (undone by
    ``_routing.unroute``, which restores the original class)."""
    processor.__class__ = owned_class(type(processor))
