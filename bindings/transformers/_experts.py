"""Expert parallelism in transformers' MoE models: ``"commlib_ep"``, an
implementation for transformers' ``ExpertsInterface`` that runs each experts
module over commlib's differentiable ``Dispatcher``, and ``expert_parallel``,
which keeps each rank's experts and switches a model to it.

Every rank runs the router on its own tokens, unchanged. Dispatch sends each
token to the ranks that own its top-k experts (expert e of E on rank
``e // (E/P)``, or under a ``commlib.moe.Placement`` the slots of its
replicas), the owner runs its slots' MLPs on contiguous row groups, and
combine returns each token's routing-weighted sum. Gradients reach the
tokens, the routing weights (hence the router) and the local expert weights.
An expert's gradient is complete on its owner, which computed every token
that used it, so its parameters carry ``_commlib_expert_parallel`` and stay
out of the data-parallel gradient sum; a replicated expert's replicas each
hold a part, which ``allreduce_gradients`` sums over them.
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from commlib.moe import Dispatcher as CoreDispatcher
from commlib.moe import Placement
from commlib.moe.contract import placement_fingerprint, placement_problem
from commlib.moe.placement import EMPTY
from commlib.moe.replicated import replicated_moe, share_size

from ..torch import Dispatcher

__all__ = ["IMPLEMENTATION", "EXPERT_PARALLEL", "register_experts", "expert_parallel",
           "replicated_tokens", "slot_experts"]

IMPLEMENTATION = "commlib_ep"
EXPERT_PARALLEL = "_commlib_expert_parallel"  # on Parameters that hold this rank's experts only
_DISPATCHER = "commlib_dispatcher"            # on experts modules made expert-parallel
_DECODE_DISPATCHERS = "_commlib_decode_dispatchers"  # theirs for replicated tokens, by share
# whether the tokens of this forward are the same on every rank (replicated_tokens()):
# a plain module flag, which torch.compile reads (and guards on) without a break;
# a ContextVar's get() breaks the graph at every experts module
_REPLICATED = {"tokens": False}
# set on every instance by transformers' ``use_experts_implementation``, with
# the decorator's defaults: a flag that a transformers version does not set yet
# (5.17 has no has_post_expert_norm) is a feature it lacks, hence its default
_FLAG_DEFAULTS = {"has_gate": True, "has_bias": False, "is_transposed": False,
                  "is_concatenated": True, "has_post_expert_norm": False}
# the flags that every supported transformers (5.17 on) sets: what marks the class
_MARKERS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")


def _flag(experts: nn.Module, name: str) -> bool:
    """The module's flag ``name``, or the decorator's default where this
    transformers version does not set it."""
    return getattr(experts, name, _FLAG_DEFAULTS[name])


def _project(experts: nn.Module, name: str, index: int, rows: torch.Tensor) -> torch.Tensor:
    """One local expert's projection ``name`` (weight [out, in], or [in, out]
    when ``is_transposed``; plus its bias when ``has_bias``)."""
    weight = getattr(experts, name)[index]
    out = rows @ weight if _flag(experts, "is_transposed") else nn.functional.linear(rows, weight)
    return out + getattr(experts, f"{name}_bias")[index] if _flag(experts, "has_bias") else out


def _expert_mlp(experts: nn.Module, index: int, rows: torch.Tensor) -> torch.Tensor:
    """Local expert ``index`` on its rows, as transformers' own experts
    forwards compute it: the gate's layout (concatenated or interleaved) is
    the module's ``_apply_gate``'s business."""
    if _flag(experts, "has_gate"):
        hidden = experts._apply_gate(_project(experts, "gate_up_proj", index, rows))
    else:
        hidden = experts.act_fn(_project(experts, "up_proj", index, rows))
    out = _project(experts, "down_proj", index, hidden)
    return experts.post_expert_norm(out) if _flag(experts, "has_post_expert_norm") else out


def _experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"commlib_ep"`` experts forward: [T, H] tokens, [T, k] global
    expert ids and routing weights -> [T, H], over the module's Dispatcher;
    for tokens every rank holds (``replicated_tokens()``: decode under
    context parallelism), each token dispatched once, sync-free."""
    dispatcher = getattr(experts, _DISPATCHER, None)
    if dispatcher is None:
        raise RuntimeError(f"{type(experts).__name__} uses experts implementation "
                           f"{IMPLEMENTATION!r} but holds all its experts: call "
                           f"expert_parallel(model, comm) instead of selecting it by name")
    if _REPLICATED["tokens"]:
        decode = _decode_dispatcher(experts, dispatcher.core, hidden_states.shape[0])
        return replicated_moe(decode, hidden_states, top_k_index, top_k_weights,
                              lambda expert_x, handle: torch.stack([
                                  _expert_mlp(experts, index, rows)
                                  for index, rows in enumerate(expert_x)])
                              ).to(hidden_states.dtype)
    expert_x, handle = dispatcher.dispatch(hidden_states, top_k_index, top_k_weights)
    if dispatcher.core.max_tokens_per_rank is not None:
        # [local experts, capacity, H]: static shapes, nothing read on the host
        # (compiles whole); the padding rows are computed and ignored by combine
        expert_y = torch.stack([_expert_mlp(experts, index, rows)
                                for index, rows in enumerate(expert_x.unbind(0))])
    else:
        groups = torch.split(expert_x, handle.tokens_per_expert.tolist())
        expert_y = torch.cat([_expert_mlp(experts, index, rows)
                              for index, rows in enumerate(groups)])
    return dispatcher.combine(expert_y, handle).to(hidden_states.dtype)


@contextlib.contextmanager
def replicated_tokens() -> Iterator[None]:
    """Inside, every experts module of ``"commlib_ep"`` takes its tokens as
    the same on every rank (decode under context parallelism): each rank
    dispatches its share (``commlib.moe.replicated``) with a fixed capacity
    (DeepEP's low-latency mode) and every rank gets every token's result."""
    before = _REPLICATED["tokens"]
    _REPLICATED["tokens"] = True
    try:
        yield
    finally:
        _REPLICATED["tokens"] = before


def _decode_dispatcher(experts: nn.Module, core: CoreDispatcher, tokens: int) -> CoreDispatcher:
    """The module's fixed-capacity Dispatcher for shares of ``tokens``
    replicated tokens (made once per share size, on every rank alike)."""
    made = experts.__dict__.setdefault(_DECODE_DISPATCHERS, {})
    share = share_size(tokens, core.comm.size)
    if share not in made:
        made[share] = CoreDispatcher(core.comm, core.num_experts, max_tokens_per_rank=share,
                                     placement=core.placement)
    return made[share]


def register_experts() -> None:
    """Register ``"commlib_ep"`` in transformers' ``ExpertsInterface``. It
    takes no communicator: each experts module runs over the Dispatcher that
    ``expert_parallel(model, comm)`` gave it, since that communicator decided
    which experts the module holds (context and expert parallelism may use
    different communicators)."""
    ExpertsInterface.register(IMPLEMENTATION, _experts_forward)


def _expert_parameter_names(experts: nn.Module) -> List[str]:
    """The parameters with one slice per expert that the flags call for."""
    weights = ["gate_up_proj" if _flag(experts, "has_gate") else "up_proj", "down_proj"]
    return weights + [f"{name}_bias" for name in weights] if _flag(experts, "has_bias") \
        else weights


def _holds_expert_weights(module: nn.Module) -> bool:
    """An experts module: ``num_experts`` and its own expert weights, 3-D
    (or more: packed quantized blocks, which ``_refusal`` then names)."""
    weight = module._parameters.get("down_proj")
    return hasattr(module, "num_experts") and weight is not None and weight.ndim >= 3


def _refusal(experts: nn.Module, comm, placement: Optional[Placement]) -> Optional[str]:
    """Why this experts module cannot be split over ``comm`` as ``placement``
    says (None: it can)."""
    kind = type(experts).__name__
    if not all(hasattr(experts, flag) for flag in _MARKERS):
        return (f"{kind} holds expert weights but is not an ExpertsInterface class "
                f"(transformers' use_experts_implementation): its forward would ignore "
                f"{IMPLEMENTATION!r}")
    if getattr(experts, "_is_expert_parallel", False):
        return (f"{kind} is already split by transformers' own expert parallelism "
                f"(distributed_config / tp_plan); use that or expert_parallel, not both")
    if hasattr(experts, _DISPATCHER):
        return f"{kind} is already expert-parallel: expert_parallel was called twice"
    count, size = experts.num_experts, comm.size
    if placement is not None:
        problem = placement_problem(comm, count, placement)
        if problem is not None:
            return f"{kind}: {problem}"
    elif count % size:
        return (f"{kind} has {count} experts, which the world size {size} does not "
                f"divide (expert e lives on rank e // (num_experts // size))")
    expected = _expert_parameter_names(experts)
    unknown = sorted(set(experts._parameters) - set(expected))
    if unknown:
        return (f"{kind} has parameters {IMPLEMENTATION!r} does not compute with: "
                f"{', '.join(unknown)} (it knows {', '.join(expected)})")
    for name in expected:
        parameter = experts._parameters.get(name)
        if parameter is None or parameter.shape[0] != count:
            found = "none" if parameter is None else f"shape {tuple(parameter.shape)}"
            return f"{kind}.{name} must hold one slice per expert ({count}), found {found}"
    return None


def _keep_local_experts(experts: nn.Module, comm, max_tokens_per_rank: Optional[int],
                        placement: Optional[Placement]) -> None:
    """Replace each expert parameter by this rank's slots, a copy of its
    own so that the full tensor's memory is freed, and attach the
    Dispatcher. Slot j holds logical expert ``placement.slots[rank][j]``
    (without a placement, expert ``rank * E/P + j``); an empty slot is
    zeros. ``num_experts`` stays global: the router's ids are logical."""
    held = slot_experts(experts.num_experts, comm.size, placement)[comm.rank]
    rows = torch.tensor([max(e, 0) for e in held])
    with torch.no_grad():
        for name in _expert_parameter_names(experts):
            full = experts._parameters[name]
            slots = full.detach()[rows.to(full.device)]
            slots[torch.tensor(held) == EMPTY] = 0
            shard = nn.Parameter(slots, requires_grad=full.requires_grad)
            setattr(shard, EXPERT_PARALLEL, True)
            setattr(experts, name, shard)
    _attach_dispatcher(experts, comm, max_tokens_per_rank, placement)


def slot_experts(num_experts: int, size: int, placement: Optional[Placement]
                 ) -> List[List[int]]:
    """The logical expert of each rank's each slot (``EMPTY``: none): by
    ``placement``, else expert ``rank * E/P + j`` in slot j."""
    if placement is not None:
        return placement.slots.tolist()
    local = num_experts // size
    return [list(range(rank * local, (rank + 1) * local)) for rank in range(size)]


def _attach_dispatcher(experts: nn.Module, comm, max_tokens_per_rank: Optional[int],
                       placement: Optional[Placement]) -> None:
    """The module's Dispatcher for ``placement`` (collective), its decode
    Dispatchers (``_decode_dispatcher``) dropped: they follow it."""
    setattr(experts, _DISPATCHER, Dispatcher(comm, experts.num_experts,
                                             max_tokens_per_rank=max_tokens_per_rank,
                                             placement=placement))
    experts.__dict__.pop(_DECODE_DISPATCHERS, None)


def expert_weights(experts: nn.Module) -> Dict[str, nn.Parameter]:
    """An expert-parallel module's expert parameters, laid out by its slots."""
    return {name: experts._parameters[name] for name in _expert_parameter_names(experts)}


def relayout(experts: nn.Module, placement: Placement, weights: Dict[str, torch.Tensor]) -> None:
    """Switch an expert-parallel module to ``placement`` (collective): its
    expert parameters (the same Parameter objects) take ``weights``, laid
    out by the placement's slots, and its Dispatchers are made for it."""
    core = dispatcher_of(experts).core
    for name, tensor in weights.items():
        experts._parameters[name].data = tensor
    _attach_dispatcher(experts, core.comm, core.max_tokens_per_rank, placement)


def decode_dispatchers(experts: nn.Module) -> List[CoreDispatcher]:
    """The fixed-capacity Dispatchers decode has made for the module, in
    the order made (the same on every rank)."""
    return list(experts.__dict__.get(_DECODE_DISPATCHERS, {}).values())


def _placements(placement: Union[None, Placement, Sequence[Placement]],
                count: int) -> Union[List[Optional[Placement]], ValueError]:
    """One placement (or None) per experts module, or why not."""
    if placement is None or isinstance(placement, Placement):
        return [placement] * count
    listed = list(placement) if isinstance(placement, (list, tuple)) else None
    if listed is None:
        return ValueError(f"placement must be a commlib.moe.Placement, a sequence of them "
                          f"(one per experts module) or None, got {type(placement).__name__}")
    if len(listed) != count:
        return ValueError(f"placement lists {len(listed)} placements, but the model has "
                          f"{count} experts modules: give one for each, in model.modules() "
                          f"order, or one for all")
    return listed


def expert_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The experts modules ``expert_parallel`` split, with their names, in
    ``model.named_modules()`` order."""
    return [(name, module) for name, module in model.named_modules()
            if hasattr(module, _DISPATCHER)]


def dispatcher_of(experts: nn.Module) -> Dispatcher:
    """An expert-parallel experts module's Dispatcher."""
    return getattr(experts, _DISPATCHER)


def placement_of(experts: nn.Module) -> Optional[Placement]:
    """The placement an expert-parallel experts module's slots follow (None:
    expert e on rank e // (E/P))."""
    return dispatcher_of(experts).core.placement


def expert_parallel(model: nn.Module, comm, *, max_tokens_per_rank: Optional[int] = None,
                    placement: Union[None, Placement, Sequence[Placement]] = None
                    ) -> nn.Module:
    """Split every experts module of ``model`` over ``comm`` (collective):
    each rank keeps experts ``rank * E/P`` to ``(rank + 1) * E/P - 1``, their
    parameters marked ``_commlib_expert_parallel``, and the experts run
    ``"commlib_ep"``. ``placement``: a ``commlib.moe.Placement`` of the
    E logical experts on ``comm``'s ranks for every experts module, or a
    sequence of them, one per experts module in ``model.modules()`` order:
    each rank then keeps one copy of logical expert e's weights for each
    of its slots holding e (``placement.slots[rank]``; an empty slot,
    zeros), and the module's Dispatcher takes the placement (replicas
    share their expert's tokens; ``allreduce_gradients`` sums their
    gradients). ``max_tokens_per_rank``: the Dispatchers' fixed
    capacity (no host read per forward: the model then compiles whole under
    ``torch.compile(fullgraph=True)``; tokens past a capacity are dropped and
    counted); default the counted mode (one graph break at each dispatch).
    Call it before building the optimizer; ``state_dict()`` then holds this
    rank's experts (slots). A model that cannot be split (E not a multiple
    of the world size without a placement, a placement of other experts or
    for another world size, a wrong number of placements, an experts class
    whose features commlib_ep does not compute) raises ValueError on every
    rank, unchanged."""
    register_experts()
    experts = [module for module in model.modules() if _holds_expert_weights(module)]
    placements = _placements(placement, len(experts))
    if isinstance(placements, ValueError):
        refusals, placements = [str(placements)], [None] * len(experts)
    else:
        refusals = []
    refusals += [reason for reason in (_refusal(module, comm, where)
                                       for module, where in zip(experts, placements))
                 if reason is not None]
    if not experts:
        refusals.append(f"{type(model).__name__} has no experts module (num_experts and 3-D "
                        f"expert weights, from transformers' use_experts_implementation)")
    problem = ValueError("; ".join(dict.fromkeys(refusals))) if refusals else None
    comm.agree("transformers.expert_parallel",
               *(f"{type(module).__name__}: {module.num_experts} experts, "
                 f"{placement_fingerprint(where)}"
                 for module, where in zip(experts, placements)), problem=problem)
    for module, where in zip(experts, placements):
        _keep_local_experts(module, comm, max_tokens_per_rank, where)
        # what the decorated forward reads; the setter reaches the config's sub-configs
        module.config._experts_implementation = IMPLEMENTATION
    return model
