"""Whether a transformers model may run on a sharded sequence: every layer
that mixes tokens along it (found by ``_token_mixers``' probe)
must be one commlib made context-parallel. Asked by ``shard_batch`` and
``generate``, which see the model; the attention, which sees only its own
layer, asks whether its model was checked (``_attention.is_checked``)."""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional

from torch import nn

from ._attention import LAYOUTS, forget_checked, mark_checked, model_check
from ._latent import install as install_latent_path
from ._latent import sparse_indexer_problem
from ._recurrent import FAMILIES, is_parallel_mixer
from ._token_mixers import Mixer, probed, structure

__all__ = ["check_model", "model_problem"]

def check_model(model: nn.Module, comm, *, before: str, longest: Optional[int] = None,
                training: bool = False) -> None:
    """Raise on every rank (collective) unless ``model`` may run on shards
    (``model_problem``). ``before``: what the caller is about to do, for
    the message."""
    comm.agree(f"transformers.{before} model", problem=model_problem(
        model, comm, before=before, longest=longest, training=training))


def model_problem(model: nn.Module, comm, *, before: str, attention_replaced: bool = False,
                  longest: Optional[int] = None, training: bool = False
                  ) -> Optional[ValueError]:
    """Why ``model`` must not run on shards over ``comm`` (None: it may):
    a token-mixing layer that is neither attention through commlib's
    registered implementations, in one layout (any attention if
    ``attention_replaced``: generate attends itself), nor a recurrent mixer
    ``recurrent_parallel`` made parallel; a rotary embedding whose
    frequencies follow the positions each rank holds, past ``longest``
    positions; in ``training``, a router loss each rank would count over its
    own tokens. Marks its attention layers checked, or not. Never raises:
    whatever goes wrong is the problem, so that every rank reaches the
    agreement."""
    if comm.size == 1:
        return None
    try:
        indexer = sparse_indexer_problem(model)
        if indexer is not None:
            return indexer
        mixers = probed(model, is_parallel_mixer)
        problem = _refusal(type(model).__name__, mixers, before, attention_replaced) or \
            _rope_problem(model, longest, before) or \
            (_router_loss_problem(model) if training else None)
    except Exception as failed:  # noqa: BLE001  (the same model fails alike on every rank)
        return failed if isinstance(failed, ValueError) else ValueError(
            f"checking {type(model).__name__} for {before} failed: "
            f"{type(failed).__name__}: {failed}")
    attending = [mixer.module for mixer in mixers if mixer.kind == "attention"]
    check = model_check(_still(getattr(model, "_orig_mod", model)), attending[0]) \
        if attending else None
    for module in attending:
        if problem is None:
            mark_checked(module, check)
            install_latent_path(module)
        else:
            forget_checked(module)
    return problem


def _still(model: nn.Module) -> Callable[[], bool]:
    """Whether ``model`` is still as it was now (the probe's key)."""
    ref, key = weakref.ref(model), structure(model)

    def still() -> bool:
        now = ref()
        return now is not None and structure(now) == key
    return still


# rotary embeddings whose frequencies follow the largest position they are given
# (transformers' dynamic_rope_update): on a shard, each rank's own largest
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_problem(model: nn.Module, longest: Optional[int], before: str
                  ) -> Optional[ValueError]:
    """A length-dependent rotary embedding is right on shards only while the
    longest document stays within the length its frequencies start from
    (then no rank switches them)."""
    for name, module in model.named_modules():
        kinds = getattr(module, "rope_type", None)
        kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
        for kind in kinds:
            if not isinstance(kind, str) or not any(k in kind for k in _LENGTH_DEPENDENT_ROPE):
                continue
            limit = _rope_limit(module, kind)
            if longest is None or limit is None or longest > limit:
                return ValueError(
                    f"{name or type(model).__name__} ({type(module).__name__}) is a {kind!r} "
                    f"rotary embedding: it picks its frequencies from the largest position it "
                    f"is given, which on a shard is each rank's own; past {limit} positions "
                    f"(here {longest}) the ranks would rotate differently. Keep documents "
                    f"within {limit} tokens for {before}, or use a rotary embedding that does "
                    f"not depend on the length (default, linear, yarn)")
    return None


def _rope_limit(module: nn.Module, kind: str) -> Optional[int]:
    """The positions a length-dependent rotary embedding serves before it
    switches frequencies (transformers' dynamic_rope_update)."""
    if kind == "longrope":
        parameters = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
        if "original_max_position_embeddings" in parameters:
            return int(parameters["original_max_position_embeddings"])
    limit = getattr(module, "original_max_seq_len", None)
    return None if limit is None else int(limit)


def _router_loss_problem(model: nn.Module) -> Optional[ValueError]:
    """An MoE router's load-balancing loss (``output_router_logits``) is
    computed by each rank over its own tokens and added to each rank's loss:
    counted once per rank, from local statistics."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules())
               if c is not None}
    if any(getattr(config, "output_router_logits", False) for config in configs.values()):
        return ValueError(
            f"{type(model).__name__} adds its routers' load-balancing loss "
            f"(config.output_router_logits), which each rank would compute over its own "
            f"tokens and add to its share of the loss: counted once per rank, from local "
            f"statistics. Not implemented under context parallelism: set "
            f"config.output_router_logits = False (or balance with "
            f"commlib.moe.BiasBalancer)")
    return None


def _names(mixers: List[Mixer]) -> str:
    shown = [mixer.describe() for mixer in mixers[:3]]
    more = len(mixers) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def _refusal(model: str, mixers: List[Mixer], before: str,
             attention_replaced: bool) -> Optional[ValueError]:
    unknown = [m for m in mixers if m.kind == "unknown"]
    recurrent = [m for m in unknown if type(m.module).__name__ in FAMILIES]
    if recurrent:
        return ValueError(f"{model}'s recurrent layers {_names(recurrent)} are not "
                          f"context-parallel: on a shard each would start from a zero state; "
                          f"call recurrent_parallel(model, comm) before {before}")
    if unknown:
        return ValueError(
            f"{model}: {_names(unknown)} mix tokens along the sequence in a way commlib does "
            f"not run on shards (each would read nothing beyond its shard's edges: silently "
            f"wrong). commlib shards only models whose token-mixing layers are attention "
            f"through its registered implementations and the recurrent mixers "
            f"recurrent_parallel makes parallel ({', '.join(FAMILIES)}); run this model "
            f"unsharded (docs/transformers.md, 'Layers commlib knows')")
    if attention_replaced:
        return None
    attending = [m for m in mixers if m.kind == "attention"]
    foreign = [m for m in attending if m.implementation not in LAYOUTS]
    if foreign:
        return ValueError(
            f"{model}: {_names(foreign)} attend with {foreign[0].implementation!r}, not one of "
            f"commlib's ({', '.join(LAYOUTS)}): load the model with "
            f"attn_implementation='commlib_ring' (or call model.set_attn_implementation) after "
            f"commlib.bindings.transformers.register(comm), before {before}")
    layouts = {LAYOUTS[m.implementation] for m in attending}
    if len(layouts) > 1:
        return ValueError(f"{model}'s attention layers attend in different layouts "
                          f"({', '.join(sorted(layouts))}); shard_batch cuts the sequence in "
                          f"one: give every layer the same commlib implementation")
    return None
