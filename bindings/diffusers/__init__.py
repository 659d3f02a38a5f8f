"""diffusers over commlib: context parallelism for diffusion transformers.

One line, after building the model the same way on every rank (launched
under ``mpiexec``; no ``torch.distributed``)::

    commlib.bindings.diffusers.context_parallel(transformer, comm, ring_degree=1)

then call the model, or a pipeline holding it, with the same global inputs
on every rank: it returns the whole output on every rank. The model's own
``_cp_plan`` says which inputs to split and which outputs to gather
(``_plan.py``, over ``_streams.py`` and ``_shards.py``: any length, shards
padded); its attention processors are routed to commlib's Ulysses, Ring or
hybrid for this model alone (``_routing.py``, ``_attention.py``), with
the padding and a whole text's copies made invisible
(``_visibility.py``). ``remove_context_parallel`` undoes it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple

import torch

from . import _projection, _routing
from ._attention import ShardedAttention, dispatch
from ._plan import check_fits, install
from ._streams import TEXT_MODES, Streams

__all__ = ["context_parallel", "remove_context_parallel", "planned_models", "TEXT_MODES"]

_STATE = "_commlib_context_parallel"

# models with a plan whose attention this package does not place, refused by name
_REFUSED = {
    "LTX2VideoTransformer3DModel":
        "its audio stream, which the plan leaves whole on every rank, attends to itself and to "
        "and from the split video (audio-to-video and video-to-audio attention); this package "
        "places only the image shard, [text | image] and attention to the text, and cannot tell "
        "a whole audio from an image shard of the same length",
    "MiniMaxH3Transformer3DModel":
        "its plan splits a packed [text | video | audio] sequence at the first block with "
        "per-row index tensors and RoPE tables split along another axis (dim 0), a layout not "
        "checked against the unsharded model here",
}


def context_parallel(model: torch.nn.Module, comm, *, ring_degree: int = 1,
                     ulysses_degree: Optional[int] = None, text: str = "sharded",
                     attention_options: Optional[Mapping[str, Any]] = None,
                     overlap_groups: Optional[int] = None) -> torch.nn.Module:
    """Make ``model`` (a diffusers transformer with a ``_cp_plan``) run
    context-parallel over ``comm``, in place, and return it. Collective:
    every rank passes its copy of the same model.

    ``ring_degree`` x ``ulysses_degree`` = ``comm.size`` (``ulysses_degree``
    defaults to the rest): Ulysses where ``ring_degree`` is 1, Ring where
    ``ulysses_degree`` is 1, else the hybrid (Ulysses inside groups of
    ``ulysses_degree`` consecutive ranks, Ring across). ``text``:
    ``"sharded"`` splits the text tokens with the image tokens, as the plan
    says; ``"whole"`` keeps them whole on every rank (joint attention counts
    one copy of each text key). ``attention_options`` go to every commlib
    attention call (``kernel=``, ``method=``; ``wire="float8"``: Ulysses'
    and the hybrid's exchange in float8, forward only). ``overlap_groups``
    (pure Ulysses only): the processors whose projection the binding owns
    (``_projection.py``: Flux's) project their heads in that many groups,
    each group's all-to-all in flight while the next is projected."""
    problem = None
    try:
        ulysses_degree = _check(model, comm, ring_degree, ulysses_degree, text)
        check_fits(model, model._cp_plan)
        _check_options(model, ring_degree, ulysses_degree, attention_options or {},
                       overlap_groups)
        routed = [processor for processor in _processors(model)]
    except ValueError as error:
        problem = error
    comm.agree("diffusers context_parallel", type(model).__name__, ring_degree,
               ulysses_degree, text, overlap_groups, problem=problem)
    streams = Streams(comm, text)
    attention = ShardedAttention(comm, streams, ring_degree, ulysses_degree,
                                 attention_options or {}, overlap_groups)
    handles = install(model, model._cp_plan, streams, comm)
    for processor in routed:
        _routing.route(processor, attention, dispatch)
        if overlap_groups is not None and _projection.owns(processor):
            _projection.own(processor)
    setattr(model, _STATE, (handles, routed))
    return model


def remove_context_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``context_parallel``: the model runs whole on each rank again."""
    if not hasattr(model, _STATE):
        raise ValueError(f"{type(model).__name__} is not context-parallel (context_parallel "
                         f"was not called on it, or was undone)")
    handles, routed = getattr(model, _STATE)
    for handle in handles:
        handle.remove()
    for processor in routed:
        _routing.unroute(processor)
    delattr(model, _STATE)
    return model


def planned_models() -> Tuple[str, ...]:
    """The diffusers transformers that declare a ``_cp_plan`` (imports
    them all)."""
    import diffusers.models.transformers as transformers

    found = []
    for name in dir(transformers):
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError, RuntimeError):  # an optional dependency missing
            continue
        if isinstance(cls, type) and getattr(cls, "_cp_plan", None):
            found.append(name)
    return tuple(sorted(found))


def _check(model: torch.nn.Module, comm, ring_degree: int, ulysses_degree: Optional[int],
           text: str) -> int:
    """The Ulysses degree, after refusing what this cannot shard (by name)."""
    name = type(model).__name__
    if not getattr(model, "_cp_plan", None):
        raise ValueError(f"{name} has no _cp_plan (diffusers' declaration of which inputs to "
                         f"split and which outputs to gather), so it cannot be made "
                         f"context-parallel; the models with one: {', '.join(planned_models())}")
    if name in _REFUSED:
        raise ValueError(f"{name} is not supported by commlib.bindings.diffusers: "
                         f"{_REFUSED[name]}")
    if hasattr(model, _STATE) or getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"{name} is already parallel (context_parallel, or diffusers' "
                         f"enable_parallelism): undo that first")
    if text not in TEXT_MODES:
        raise ValueError(f"text={text!r}: use one of {', '.join(TEXT_MODES)}")
    for what, degree in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)
                                   or degree < 1):
            raise ValueError(f"{what}={degree!r} must be a positive int")
    if ulysses_degree is None:
        if comm.size % ring_degree:
            raise ValueError(f"ring_degree ({ring_degree}) must divide the number of ranks "
                             f"({comm.size})")
        ulysses_degree = comm.size // ring_degree
    if ring_degree * ulysses_degree != comm.size:
        raise ValueError(f"ring_degree ({ring_degree}) x ulysses_degree ({ulysses_degree}) "
                         f"must equal the number of ranks ({comm.size})")
    return ulysses_degree


def _check_options(model: torch.nn.Module, ring_degree: int, ulysses_degree: int,
                   options: Mapping[str, Any], overlap_groups: Optional[int]) -> None:
    """Refuse a wire with no all-to-all to carry it, and overlap groups
    outside pure Ulysses or that the owned processors' heads cannot take."""
    if options.get("wire") is not None and ulysses_degree == 1 and ring_degree > 1:
        raise ValueError(f"attention_options wire={options['wire']!r} is the Ulysses "
                         f"exchange's: pure Ring (ulysses_degree=1) has none; use Ulysses or "
                         f"the hybrid, or no wire")
    if overlap_groups is None:
        return
    if isinstance(overlap_groups, bool) or not isinstance(overlap_groups, int) or \
            overlap_groups < 1:
        raise ValueError(f"overlap_groups={overlap_groups!r} must be a positive int")
    if ring_degree != 1:
        raise ValueError(f"overlap_groups={overlap_groups} overlaps Ulysses' all-to-all with "
                         f"the projection: pure Ulysses only (ring_degree=1), not "
                         f"ring_degree={ring_degree}")
    _projection.check_groups(model, overlap_groups, ulysses_degree)


def _processors(model: torch.nn.Module):
    """Every attention processor of the model, each checked to be one that
    commlib can route (any other would attend over its shard alone)."""
    seen = set()
    for module_name, module in model.named_modules():
        processor = getattr(module, "processor", None)
        if processor is None or id(processor) in seen:
            continue
        seen.add(id(processor))
        if not _routing.routable(processor):
            raise ValueError(f"{type(model).__name__}.{module_name}: its attention processor "
                             f"{type(processor).__name__} does not compute attention through "
                             f"diffusers' dispatch_attention_fn with a _parallel_config, so "
                             f"commlib cannot route it across ranks (it would attend over its "
                             f"shard alone)")
        yield processor
