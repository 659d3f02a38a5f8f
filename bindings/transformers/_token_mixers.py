"""Which layers of a transformers model mix tokens along the sequence, found
by running the model, not by a list of the families known today.

A sharded batch is right only if every layer that reads other tokens than
its own is one commlib made context-parallel: its attention (through
transformers' attention interface, under one of commlib's names) or a
recurrent mixer ``recurrent_parallel`` replaced. Any other such layer (a
short convolution, a mixer of a new family, an attention computed by hand)
would read zeros, or nothing, at its shard's edges: silently wrong. So the
model is probed once per structure: it runs on a short random sequence in
one process (commlib's attention, experts and parallel mixers stood in for by
local computations, so nothing is communicated), every module's inputs are
kept, and each module is run again with its input changed at its first
position, and at its last. A module whose outputs change at other positions
mixes tokens; running its
attention as the identity (each token's own value) and its mixing
descendants frozen at their outputs tells whether the mixing is its
attention's, a descendant's or its own code's.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module  # its process-wide forward hooks
from transformers import AttentionInterface
from transformers.integrations.moe import ExpertsInterface

from ._attention import LAYOUTS

__all__ = ["Mixer", "Structure", "token_mixers", "probed", "probing", "structure",
           "what_changed", "PROBE_LENGTH"]

PROBE_LENGTH = 13  # tokens: prime, so that no hidden size or head count is mistaken for it
# the positions whose input changes, one at a time: the first (every later token may read it)
# and the last (every earlier one may); a mixer of tokens further apart than this is not seen
_CHANGED = (0, PROBE_LENGTH - 1)


@dataclass(frozen=True)
class Mixer:
    """A module that mixes tokens along the sequence. ``kind``:
    ``"attention"`` (only through the attention interface, under
    ``implementation``), ``"parallel"`` (made context-parallel by commlib) or
    ``"unknown"`` (in its own code, or an attention it does not delegate)."""

    name: str
    module: nn.Module
    kind: str
    implementation: Optional[str] = None

    def describe(self) -> str:
        return f"{self.name or 'the model'} ({type(self.module).__name__})"


_PROBING = {"now": False}  # a plain flag: read by hooks at every forward


def probing() -> bool:
    """Whether the model runs for the probe (commlib's checks at a forward,
    which communicate, stand aside: the probe runs in one process)."""
    return _PROBING["now"]


class _Probe:
    """The attention stand-ins' state: which modules attended, under which
    implementation, and whether the attention runs as the identity."""

    def __init__(self) -> None:
        self.attended: Dict[int, str] = {}
        self.identity = False

    def attention(self, implementation: str) -> Callable:
        def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                   scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                   **_: Any) -> Tuple[torch.Tensor, None]:
            self.attended.setdefault(id(module), implementation)
            group = query.shape[1] // key.shape[1]
            key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
            if self.identity:  # each query's own token, read from its value
                return value[:, :, :query.shape[2]].transpose(1, 2), None
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
            out = nn.functional.scaled_dot_product_attention(
                query, key, value, scale=scaling,
                attn_mask=None if attention_mask is None else attention_mask.bool(),
                is_causal=causal and attention_mask is None and query.shape[2] == key.shape[2])
            return out.transpose(1, 2), None
        return attend


def _zeros_like_hidden(*args: Any, **kwargs: Any) -> torch.Tensor:
    """A stand-in for a module that returns a tensor shaped like its
    ``hidden_states``: token-local, and communicates nothing."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    return torch.zeros_like(hidden)


@contextlib.contextmanager
def _replaced(mapping: Dict[str, Any], entries: Dict[str, Any]) -> Iterator[None]:
    saved = {key: mapping[key] for key in entries if key in mapping}
    mapping.update(entries)
    try:
        yield
    finally:
        for key in entries:
            mapping.pop(key, None)
        mapping.update(saved)


@contextlib.contextmanager
def _forwards(modules: Sequence[Tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each module's forward replaced, then given back (an instance's own
    forward, as commlib's patches are, restored as it was)."""
    saved = [(module, module.__dict__.get("forward")) for module, _ in modules]
    for module, forward in modules:
        module.forward = forward
    try:
        yield
    finally:
        for module, own in saved:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _copy(value: Any) -> Any:
    """A detached copy of the tensors in ``value`` (later in-place updates
    of the model must not change what was kept)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value) if not hasattr(value, "_fields") \
            else type(value)(*(_copy(v) for v in value))
    if isinstance(value, dict):
        copied = {k: _copy(v) for k, v in value.items()}
        try:
            return type(value)(**copied)
        except TypeError:
            return copied
    return value


def _sequence_input(args: Tuple[Any, ...], kwargs: Dict[str, Any]
                    ) -> Optional[Tuple[Optional[int], Optional[str]]]:
    """Where the module's token sequence comes in ([1, PROBE_LENGTH, ...]):
    (positional index, None) or (None, keyword); None if it takes none."""
    def is_sequence(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.ndim >= 2 and \
            tuple(value.shape[:2]) == (1, PROBE_LENGTH)
    if is_sequence(kwargs.get("hidden_states")):
        return None, "hidden_states"
    for index, value in enumerate(args):
        if is_sequence(value):
            return index, None
    for key in ("input_ids", "inputs_embeds", "x"):
        if is_sequence(kwargs.get(key)):
            return None, key
    return None


def _changed(value: torch.Tensor, position: int) -> torch.Tensor:
    """``value`` changed at ``position``, by far more than its own values (so
    that a mixer reading it with a small weight still moves the others by
    more than rounding)."""
    changed = value.clone()
    if value.is_floating_point():
        signs = torch.ones(value[:, position].shape, dtype=value.dtype, device=value.device)
        signs.view(-1)[::2] = -1
        changed[:, position] += 64 * (float(value.abs().max()) + 1) * signs
    else:  # token ids: the next id (the probe draws none at the top of the vocabulary)
        changed[:, position] += 1
    return changed


def _tensors(output: Any) -> List[torch.Tensor]:
    """The floating-point tensors of an output."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    return []


def _sequences(output: Any) -> List[torch.Tensor]:
    """The floating-point [1, PROBE_LENGTH, ...] tensors of an output."""
    return [t for t in _tensors(output)
            if t.ndim >= 2 and tuple(t.shape[:2]) == (1, PROBE_LENGTH)]


def _pooled(output: Any) -> List[torch.Tensor]:
    """The floating-point [1, ...] tensors of an output with no axis as long
    as the sequence: pooled from it, one per row (a pooler's first token, a
    classifier's mean), which on a shard would pool the shard alone. A
    scalar (an MoE's auxiliary loss) is no row's: ``_model_check`` refuses
    the router loss where it would be added."""
    return [t for t in _tensors(output)
            if t.ndim >= 2 and t.shape[0] == 1 and PROBE_LENGTH not in t.shape[1:]]


def _mixes(before: Any, after: Any, position: int) -> bool:
    """Whether some output changed at a position other than ``position``
    (an output pooled from the sequence: anywhere), beyond the square root
    of its dtype's rounding (a token-local module changes nothing there, up
    to reassociated sums)."""
    others = [i for i in range(PROBE_LENGTH) if i != position]
    moved = [(a, a[:, others] - b[:, others])
             for a, b in zip(_sequences(before), _sequences(after))]
    moved += [(a, a - b) for a, b in zip(_pooled(before), _pooled(after)) if a.numel()]
    for a, difference in moved:
        difference = torch.nan_to_num(difference.abs().float(), nan=0.0)
        scale = float(torch.nan_to_num(a.abs().float(), nan=0.0).max())
        if float(difference.max()) > math.sqrt(torch.finfo(a.dtype).eps) * scale:
            return True
    return False


def token_mixers(model: nn.Module, *, parallel: Callable[[nn.Module], bool]) -> List[Mixer]:
    """Every module of ``model`` that mixes tokens along the sequence, found
    by the probe (module docstring), innermost first. ``parallel(module)``:
    whether commlib made that module context-parallel (it is stood in for
    by zeros, and not run). Runs the model in one process, in eval mode,
    without gradients; communicates nothing."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: probe the model
    names = {id(module): name for name, module in model.named_modules()}
    known = [Mixer(names[id(m)], m, "parallel") for m in model.modules() if parallel(m)]
    probe = _Probe()
    # every name a model may attend under: transformers', commlib's (registered or not yet)
    attention = {name: probe.attention(name)
                 for name in (*AttentionInterface._global_mapping, *LAYOUTS, "eager")}
    experts = {name: _experts_zeros for name in ExpertsInterface._global_mapping
               if name.startswith("commlib")}
    calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any], Any]] = {}
    order: List[nn.Module] = []

    def keep(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
             output: Any) -> None:
        if id(module) not in calls:
            calls[id(module)] = (_copy(args), _copy(kwargs), _copy(output))
            order.append(module)

    embeddings = model.get_input_embeddings()
    vocabulary = embeddings.num_embeddings if embeddings is not None else 2
    tokens = torch.randint(0, max(vocabulary - 1, 1), (1, PROBE_LENGTH),
                           generator=torch.Generator().manual_seed(0))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    training, _PROBING["now"] = model.training, True
    hooks = [m.register_forward_hook(keep, with_kwargs=True) for m in model.modules()
             if not any(m is k.module for k in known)]
    try:
        with torch.no_grad(), _replaced(AttentionInterface._global_mapping, attention), \
                _replaced(ExpertsInterface._global_mapping, experts), \
                _forwards([(k.module, _zeros_like_hidden) for k in known]):
            model.eval()
            try:
                model(input_ids=tokens.to(device), use_cache=False)
            except Exception as error:  # what the model needs besides tokens, say
                raise ValueError(f"commlib runs {type(model).__name__} once on "
                                 f"{PROBE_LENGTH} random tokens to find the layers that mix "
                                 f"them, and it failed ({type(error).__name__}: {error}); a "
                                 f"model that cannot run on tokens alone cannot be checked"
                                 ) from error
            for hook in hooks:
                hook.remove()
            hooks = []
            probe.identity = True
            unknown = _own_mixers(order, calls)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(training)
        _PROBING["now"] = False
    unknown_ids = {id(m) for m in unknown}
    return known + [Mixer(names[id(m)], m, "unknown" if id(m) in unknown_ids else "attention",
                          probe.attended.get(id(m)))
                    for m in order if id(m) in unknown_ids or id(m) in probe.attended]


def _experts_zeros(experts: nn.Module, hidden_states: torch.Tensor, *_: Any,
                   **__: Any) -> torch.Tensor:
    """commlib's expert-parallel experts, stood in for by zeros: token-local,
    and the probe does not dispatch."""
    return torch.zeros_like(hidden_states)


def _own_mixers(order: List[nn.Module],
                calls: Dict[int, Tuple[Tuple[Any, ...], Dict[str, Any], Any]]
                ) -> List[nn.Module]:
    """The modules whose own code (or undelegated attention) mixes tokens:
    each run on its kept inputs, then on them changed at the first position
    and at the last, with the attention as the identity and the mixers found
    inside it (innermost first: ``order`` is the order modules finished)
    returning what they returned in the probe."""
    found: List[nn.Module] = []
    for module in order:
        args, kwargs, _ = calls[id(module)]
        where = _sequence_input(args, kwargs)
        if where is None:
            continue
        inside = {id(m) for m in module.modules()}
        frozen = [(m, _returning(calls[id(m)][2])) for m in found if id(m) in inside]
        with _forwards(frozen):
            before = module(*_copy(args), **_copy(kwargs))
            for position in _CHANGED:
                changed_args, changed_kwargs = _with_changed(args, kwargs, where, position)
                if _mixes(before, module(*changed_args, **changed_kwargs), position):
                    found.append(module)
                    break
    return found


def _with_changed(args: Tuple[Any, ...], kwargs: Dict[str, Any],
                  where: Tuple[Optional[int], Optional[str]], position: int
                  ) -> Tuple[List[Any], Dict[str, Any]]:
    """The module's inputs with its sequence changed at ``position``."""
    index, key = where
    changed_args, changed_kwargs = list(args), dict(kwargs)
    if key is None:
        changed_args[index] = _changed(args[index], position)
    else:
        changed_kwargs[key] = _changed(kwargs[key], position)
    return changed_args, changed_kwargs


def _returning(output: Any) -> Callable:
    """A forward that returns ``output`` whatever it is given."""
    def forward(*_: Any, **__: Any) -> Any:
        return _copy(output)
    return forward


# ---- the verdict ---------------------------------------------------------------------------
class _ModuleKey(NamedTuple):
    """What of one module the probe's answer depends on beyond its
    parameters: which module, its class (a ``__class__`` swap), its own
    forward (commlib's patches, anyone's), its forward hooks (by handle:
    one removed and added again is another)."""

    module: int
    cls: type
    forward: int
    pre_hooks: Tuple[int, ...]
    hooks: Tuple[int, ...]


class Structure(NamedTuple):
    """What the probe's answer depends on: the attention implementation,
    the process-wide forward hooks, and each module's key (``_ModuleKey``'s fields), in
    ``model.modules()`` order. A hook or a class swapped in after the check
    mixes tokens as well as the module's own code could."""

    implementation: Optional[str]
    global_hooks: Tuple[Tuple[int, ...], Tuple[int, ...]]
    modules: Tuple[Tuple[Any, ...], ...]


def structure(model: nn.Module) -> Structure:
    """``model``'s ``Structure`` now."""
    return Structure(
        getattr(getattr(model, "config", None), "_attn_implementation", None),
        (tuple(torch_module._global_forward_pre_hooks),
         tuple(torch_module._global_forward_hooks)),
        # plain tuples in _ModuleKey's order: asked once a forward, a NamedTuple a module costs
        tuple((id(m), type(m), id(m.__dict__.get("forward")), tuple(m._forward_pre_hooks),
               tuple(m._forward_hooks)) for m in model.modules()))


def what_changed(model: nn.Module, before: Structure) -> Optional[str]:
    """What differs in ``model`` from ``before`` (None: nothing), named for
    a message: the attention implementation, or the first module changed."""
    now = structure(model)
    if now == before:
        return None
    if now.implementation != before.implementation:
        return (f"its attention implementation is now {now.implementation!r} (it was "
                f"{before.implementation!r})")
    if now.global_hooks != before.global_hooks:
        return "a global forward hook was registered or removed (register_module_forward_hook)"
    names = [name for name, _ in model.named_modules()]
    if len(now.modules) != len(before.modules):
        return f"modules were added or removed ({len(before.modules)} then, {len(now.modules)} now)"
    for name, was, now_key in zip(names, before.modules, now.modules):
        if was == now_key:
            continue
        old, new = _ModuleKey(*was), _ModuleKey(*now_key)
        what = ("it is another module" if old.module != new.module else
                f"its class is now {new.cls.__name__} (it was {old.cls.__name__})"
                if old.cls is not new.cls else
                "its forward was replaced" if old.forward != new.forward else
                "a forward pre-hook was added or removed" if old.pre_hooks != new.pre_hooks else
                "a forward hook was added or removed")
        return f"{name or 'the model'} ({new.cls.__name__}): {what}"
    return None


_verdicts: "weakref.WeakKeyDictionary[nn.Module, Tuple[Structure, List[Mixer]]]" = \
    weakref.WeakKeyDictionary()


def probed(model: nn.Module, parallel: Callable[[nn.Module], bool]) -> List[Mixer]:
    """``token_mixers(model)``, probed again only when the model changed."""
    model = getattr(model, "_orig_mod", model)
    key = structure(model)
    kept = _verdicts.get(model)
    if kept is None or kept[0] != key:
        kept = _verdicts[model] = (key, token_mixers(model, parallel=parallel))
    return kept[1]
