"""Which models have context-parallel recurrent layers, for commlib's
attention to ask. A model with recurrent layers (Gated DeltaNet, Mamba2)
that sees a sharded batch must have had them made parallel
(``recurrent_parallel``): unpatched, each would start from a zero state on
every rank, silently wrong. The mark is kept beside the model's config, not
in it: a config attribute would be saved with the model and vouch for the
layers of an unpatched model loaded from it."""

from __future__ import annotations

import weakref
from typing import Any, Dict

__all__ = ["has_recurrent_layers", "mark_parallel", "is_parallel"]

# the layer kinds transformers' hybrid configs list for recurrent layers
# (Qwen3-Next, Bamba, Granite-MoE-Hybrid, Mamba2, Nemotron-H; Falcon-H1's "hybrid")
_RECURRENT_KINDS = {"linear_attention", "mamba", "hybrid"}
_parallel: Dict[int, "weakref.ref[Any]"] = {}


def has_recurrent_layers(config: Any) -> bool:
    kinds = set(getattr(config, "layer_types", None) or ()) | \
        set(getattr(config, "layers_block_type", None) or ())
    return bool(kinds & _RECURRENT_KINDS)


def mark_parallel(config: Any) -> None:
    """The model of ``config`` has every recurrent layer context-parallel."""
    _parallel[id(config)] = weakref.ref(config, lambda _: _parallel.pop(id(config), None))


def is_parallel(config: Any) -> bool:
    ref = _parallel.get(id(config))
    return ref is not None and ref() is config
