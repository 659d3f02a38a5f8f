"""diffusers over commlib: context parallelism for diffusion transformers.

One line, after building the model the same way on every rank (launched
under ``mpiexec``; no ``torch.distributed``)::

    commlib.bindings.diffusers.context_parallel(transformer, comm, ring_degree=1)

(or a pipeline: its transformers), then call the model, or the pipeline,
with the same global inputs on every rank: it returns the whole output on
every rank. The weights and every forward's inputs are agreed by every
rank (``_weights.py``, ``_fingerprints.py``; diffusers' own methods that
would change them, or parallelize the model again, are intercepted:
``_guards.py``). The model's own
``_cp_plan`` says which inputs to split and which outputs to gather
(``_plan.py``, over ``_streams.py`` and ``_shards.py``: any length, shards
padded); its attention processors are routed to commlib's Ulysses, Ring or
hybrid for this model alone (``_routing.py``, ``_attention.py``), with
the padding and a whole text's copies made invisible
(``_visibility.py``). ``remove_context_parallel`` undoes it.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Tuple, TypeVar

import torch

from commlib import Communicator

from . import _projection, _routing
from ._attention import ShardedAttention, dispatch
from ._fingerprints import agree
from ._guards import guard, unguard
from ._plan import check_fits, install
from ._streams import TEXT_MODES, Streams
from ._weights import SAME_WEIGHTS, Weights

__all__ = ["context_parallel", "remove_context_parallel", "planned_models", "refused_models",
           "TEXT_MODES", "ATTENTION_OPTIONS"]

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


# a model, or a pipeline holding one
Parallel = TypeVar("Parallel")

# the attention_options keys, and the algorithms whose commlib function takes each
ATTENTION_OPTIONS = {"kernel": ("ulysses", "ring", "hybrid"), "method": ("ring", "hybrid"),
                     "wire": ("ulysses", "hybrid")}


def context_parallel(model: Parallel, comm: Communicator, *, ring_degree: Optional[int] = None,
                     ulysses_degree: Optional[int] = None, config: Any = None,
                     text: str = "sharded", attention_options: Optional[Mapping[str, Any]] = None,
                     overlap_groups: Optional[int] = None) -> Parallel:
    """Make ``model`` (a diffusers transformer with a ``_cp_plan``, or a
    pipeline: each of its transformers, Wan 2.2's ``transformer`` and
    ``transformer_2``) run context-parallel over ``comm``, in place, and
    return it. Collective: every rank passes its copy of the same model;
    the weights are agreed now, and the inputs at every forward.

    ``ring_degree`` x ``ulysses_degree`` = ``comm.size`` (either defaults
    to the rest, ``ring_degree`` to 1 where neither is given; or both from
    ``config``, diffusers' ``ContextParallelConfig``): Ulysses where
    ``ring_degree`` is 1, Ring where ``ulysses_degree`` is 1, else the hybrid
    (Ulysses inside groups of ``ulysses_degree`` consecutive ranks, Ring
    across). ``text``: ``"sharded"`` splits the text tokens with the image
    tokens, as the plan says; ``"whole"`` keeps them whole on every rank
    (joint attention counts one copy of each text key). ``attention_options``
    go to every commlib attention call (``ATTENTION_OPTIONS``: ``kernel=``,
    ``method=``; ``wire="float8"``: Ulysses' and the hybrid's exchange in
    float8, forward only). ``overlap_groups`` (pure Ulysses only): the
    processors whose projection the binding owns (``_projection.py``:
    Flux's) project their heads in that many groups, each group's all-to-all
    in flight while the next is projected."""
    _check_comm(comm)
    problem, targets = None, []
    try:
        targets = _targets(model)
    except ValueError as error:
        problem = error
    comm.agree("diffusers context_parallel of", type(model).__name__, len(targets),
               problem=problem)
    done: List[torch.nn.Module] = []
    try:
        for target in targets:
            _make_parallel(target, comm, ring_degree, ulysses_degree, config, text,
                           attention_options or {}, overlap_groups)
            done.append(target)
    except BaseException:
        for target in done:  # a pipeline's transformers: all of them, or none
            remove_context_parallel(target)
        raise
    return model


def remove_context_parallel(model: Parallel) -> Parallel:
    """Undo ``context_parallel``: the model (a pipeline: its transformers)
    runs whole on each rank again."""
    for target in _targets(model):
        if not hasattr(target, _STATE):
            raise ValueError(f"{type(target).__name__} is not context-parallel (context_parallel "
                             f"was not called on it, or was undone)")
        handles, routed, guarded = getattr(target, _STATE)
        for handle in handles:
            handle.remove()
        for processor in routed:
            _routing.unroute(processor)
        unguard(target, guarded)
        delattr(target, _STATE)
    return model


def planned_models() -> Tuple[str, ...]:
    """The diffusers transformers that ``context_parallel`` takes: those
    that declare a ``_cp_plan`` (imports them all), but the ones it refuses
    (``refused_models``)."""
    import diffusers.models.transformers as transformers

    found = []
    for name in dir(transformers):
        try:
            cls = getattr(transformers, name)
        except (ImportError, AttributeError, RuntimeError):  # an optional dependency missing
            continue
        if isinstance(cls, type) and getattr(cls, "_cp_plan", None) and name not in _REFUSED:
            found.append(name)
    return tuple(sorted(found))


def refused_models() -> Mapping[str, str]:
    """The diffusers transformers that declare a ``_cp_plan`` but that
    ``context_parallel`` refuses, each with the reason."""
    return dict(_REFUSED)


def _make_parallel(model: torch.nn.Module, comm: Communicator, ring_degree: Optional[int],
                   ulysses_degree: Optional[int], config: Any, text: str,
                   options: Mapping[str, Any], overlap_groups: Optional[int]) -> None:
    """``context_parallel`` of one transformer: checked and agreed, its
    weights agreed, then hooks, routes and guards installed."""
    problem, routed = None, []
    try:
        ring_degree, ulysses_degree = _degrees(comm, ring_degree, ulysses_degree, config)
        _check(model, text)
        check_fits(model, model._cp_plan)
        _check_options(model, ring_degree, ulysses_degree, options, overlap_groups)
        routed = list(_processors(model))
    except ValueError as error:
        problem = error
    name = type(model).__name__
    comm.agree("diffusers context_parallel", name, ring_degree, ulysses_degree, text,
               overlap_groups, problem=problem)
    weights = Weights(model)
    agree(comm, "diffusers context_parallel weights", f"the weights of {name}",
          [weights.item()], SAME_WEIGHTS)
    streams = Streams(comm, text, weights, name)
    attention = ShardedAttention(comm, streams, ring_degree, ulysses_degree, options,
                                 overlap_groups)
    handles = install(model, model._cp_plan, streams, comm)
    for processor in routed:
        _routing.route(processor, attention, dispatch)
        if overlap_groups is not None and _projection.owns(processor):
            _projection.own(processor)
    setattr(model, _STATE, (handles, routed, guard(model, weights)))


def _check_comm(comm: Any) -> None:
    """The communicator, before anything collective (a wrong one cannot
    tell the other ranks: each raises alike)."""
    from diffusers import ContextParallelConfig

    if isinstance(comm, Communicator):
        return
    hint = (": diffusers' ContextParallelConfig goes in config= (context_parallel(model, comm, "
            "config=...)), with comm = commlib.init()"
            if isinstance(comm, ContextParallelConfig) else " (commlib.init())")
    raise TypeError(f"comm must be a commlib Communicator, not a {type(comm).__name__}{hint}")


def _targets(model: Any) -> List[torch.nn.Module]:
    """The transformers to make parallel: the model, or a pipeline's
    components named ``transformer``, ``transformer_2``, ..."""
    if isinstance(model, torch.nn.Module):
        return [model]
    components = getattr(model, "components", None)
    if not isinstance(components, dict):
        raise ValueError(f"context_parallel takes a diffusers transformer or a pipeline holding "
                         f"one, not a {type(model).__name__}")
    found = [component for key, component in components.items()
             if "transformer" in key and isinstance(component, torch.nn.Module)]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no transformer (no component named "
                         f"transformer*: {', '.join(components)}); pass the model itself")
    return found


def _degrees(comm: Communicator, ring_degree: Optional[int], ulysses_degree: Optional[int],
             config: Any) -> Tuple[int, int]:
    """(ring degree, Ulysses degree), from the arguments or from diffusers'
    ``ContextParallelConfig``, checked against the number of ranks."""
    from diffusers import ContextParallelConfig

    if config is not None:
        if not isinstance(config, ContextParallelConfig):
            raise ValueError(f"config= takes diffusers' ContextParallelConfig, not a "
                             f"{type(config).__name__}")
        if ring_degree is not None or ulysses_degree is not None:
            raise ValueError("the degrees were given twice (config= and ring_degree= / "
                             "ulysses_degree=): give them once")
        if config.mesh is not None:
            raise ValueError("ContextParallelConfig(mesh=...): commlib places the ranks by "
                             "comm (Ulysses groups of ulysses_degree consecutive ranks), not by "
                             "a torch DeviceMesh; leave mesh out")
        ring_degree, ulysses_degree = config.ring_degree, config.ulysses_degree
    for what, degree in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        if degree is not None and (isinstance(degree, bool) or not isinstance(degree, int)
                                   or degree < 1):
            raise ValueError(f"{what}={degree!r} must be a positive int")
    if ring_degree is None and ulysses_degree is None:
        ring_degree = 1
    if ulysses_degree is None:
        if comm.size % ring_degree:
            raise ValueError(f"ring_degree ({ring_degree}) must divide the number of ranks "
                             f"({comm.size})")
        ulysses_degree = comm.size // ring_degree
    elif ring_degree is None:
        if comm.size % ulysses_degree:
            raise ValueError(f"ulysses_degree ({ulysses_degree}) must divide the number of "
                             f"ranks ({comm.size})")
        ring_degree = comm.size // ulysses_degree
    if ring_degree * ulysses_degree != comm.size:
        raise ValueError(f"ring_degree ({ring_degree}) x ulysses_degree ({ulysses_degree}) "
                         f"must equal the number of ranks ({comm.size})")
    return ring_degree, ulysses_degree


def _check(model: torch.nn.Module, text: str) -> None:
    """Refuse, by name, what this cannot shard."""
    name = type(model).__name__
    if not getattr(model, "_cp_plan", None):
        raise ValueError(f"{name} has no _cp_plan (diffusers' declaration of which inputs to "
                         f"split and which outputs to gather), so it cannot be made "
                         f"context-parallel; the models that can: {', '.join(planned_models())} "
                         f"({' and '.join(_REFUSED)} declare one too, but are refused: "
                         f"refused_models() says why)")
    if name in _REFUSED:
        raise ValueError(f"{name} is not supported by commlib.bindings.diffusers: "
                         f"{_REFUSED[name]}")
    if hasattr(model, _STATE) or getattr(model, "_parallel_config", None) is not None:
        raise ValueError(f"{name} is already parallel (context_parallel, or diffusers' "
                         f"enable_parallelism): undo that first")
    if text not in TEXT_MODES:
        raise ValueError(f"text={text!r}: use one of {', '.join(TEXT_MODES)}")


def _check_options(model: torch.nn.Module, ring_degree: int, ulysses_degree: int,
                   options: Mapping[str, Any], overlap_groups: Optional[int]) -> None:
    """Refuse options commlib's attention does not take (a typo, diffusers'
    own ``parallel_config``), a wire with no all-to-all to carry it, and
    overlap groups outside pure Ulysses or that the owned processors' heads
    cannot take."""
    algorithm = "ulysses" if ring_degree == 1 else "ring" if ulysses_degree == 1 else "hybrid"
    unknown = sorted(map(str, set(options) - set(ATTENTION_OPTIONS)))
    if unknown:
        accepted = "; ".join(f"{key} ({', '.join(algorithms)})"
                             for key, algorithms in ATTENTION_OPTIONS.items())
        raise ValueError(f"attention_options {', '.join(unknown)}: not an option of commlib's "
                         f"attention; the accepted keys: {accepted}")
    if options.get("wire") is not None and algorithm == "ring":
        raise ValueError(f"attention_options wire={options['wire']!r} is the Ulysses "
                         f"exchange's: pure Ring (ulysses_degree=1) has none; use Ulysses or "
                         f"the hybrid, or no wire")
    if "method" in options and algorithm == "ulysses":
        raise ValueError(f"attention_options method={options['method']!r} picks Ring's "
                         f"schedule: pure Ulysses (ring_degree=1) has no ring; use Ring or the "
                         f"hybrid, or no method")
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
