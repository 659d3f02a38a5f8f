"""Whether a transformers model may run on a sharded sequence: every layer
that mixes tokens along it (found by ``_token_mixers``' probe)
must be one commlib made context-parallel. Asked by ``shard_batch`` and
``generate``, which see the model; the attention, which sees only its own
layer, asks whether its model was checked (``_attention.is_checked``)."""

from __future__ import annotations

from typing import List, Optional

from torch import nn

from ._attention import LAYOUTS, mark_checked
from ._recurrent import FAMILIES, is_parallel_mixer
from ._token_mixers import Mixer, probed

__all__ = ["check_model", "model_problem"]

def check_model(model: nn.Module, comm, *, before: str) -> None:
    """Raise on every rank (collective) unless every token-mixing layer of
    ``model`` is context-parallel (``model_problem``). ``before``: what
    the caller is about to do, for the message."""
    comm.agree(f"transformers.{before} model", problem=model_problem(model, comm, before=before))


def model_problem(model: nn.Module, comm, *, before: str, attention_replaced: bool = False
                  ) -> Optional[ValueError]:
    """Why ``model`` must not run on shards over ``comm`` (None: it may):
    a token-mixing layer that is neither attention through commlib's
    registered implementations, in one layout (any attention if
    ``attention_replaced``: generate attends itself), nor a recurrent mixer
    ``recurrent_parallel`` made parallel. Marks its attention layers
    checked, or not."""
    try:
        mixers = probed(model, is_parallel_mixer) if comm.size > 1 else []
    except ValueError as failed:  # the model could not be probed: the same on every rank
        return failed
    problem = _refusal(type(model).__name__, mixers, before, attention_replaced)
    for mixer in mixers:
        config = getattr(mixer.module, "config", None)
        if mixer.kind == "attention" and config is not None:
            mark_checked(config, problem is None)
    return problem


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
