"""What every MoE Dispatcher (``commlib.moe``, ``bindings.torch``,
``bindings.jax``) accepts and refuses, in one place: the three give the same
error for the same bad option or input, word for word, and hand back handles
of one shape (``MoEHandle``). Each check returns the problem instead of
raising it, so the caller can pass it to ``agree`` and raise it on every
rank."""

from __future__ import annotations

import hashlib
import math
from typing import Any, List, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from ..namespace import device, dtype_name, framework, framework_of
from .placement import Placement
from .quantize import quantize_fp8
from .stats import DispatchStats

DROP_POLICIES = ("probs", "position")
QUANTIZE = (None, "fp8")
# expert ids travel as float32 beside the weights (in each row's message);
# float32 holds every integer below 2**24 exactly
MAX_EXPERTS = 2 ** 24


@runtime_checkable
class MoEHandle(Protocol):
    """What ``dispatch`` returns beside ``expert_x`` and ``combine`` takes
    back, in every binding. ``tokens_per_expert[e]``: the real rows of this
    rank's local expert e in ``expert_x`` (host int64 when counted, an array
    on the device under a fixed capacity); ``stats``: this dispatch's global
    ``DispatchStats``, or None where they stay on the device until
    ``Dispatcher.collect_stats()`` (fixed capacity, JAX)."""

    @property
    def tokens_per_expert(self) -> Any: ...

    @property
    def stats(self) -> Optional[DispatchStats]: ...


def options_problem(comm, num_experts: Any, capacity_factor: Any, drop_policy: Any,
                    hierarchical: Any, max_tokens_per_rank: Any, pipeline_chunks: Any = None,
                    two_hop: bool = True, placement: Any = None) -> Optional[ValueError]:
    """What is wrong with a Dispatcher's options on this rank (None:
    nothing). ``two_hop``: whether this Dispatcher has the two-hop path (the
    JAX one has not, so it refuses ``hierarchical`` and ``pipeline_chunks``
    above 1 instead of ignoring them)."""
    if placement is not None:
        problem = placement_problem(comm, num_experts, placement)
        if problem is not None:
            return problem
    elif isinstance(num_experts, bool) or not isinstance(num_experts, int) \
            or num_experts < 1 or num_experts % comm.size:
        return ValueError(f"num_experts={num_experts!r} must be a positive multiple of "
                          f"the world size {comm.size} (expert e lives on rank "
                          f"e // (num_experts // size))")
    if slot_count(num_experts, placement) > MAX_EXPERTS:
        return ValueError(f"{slot_count(num_experts, placement)} experts (physical slots) "
                          f"exceed {MAX_EXPERTS}, the most whose ids travel exactly in the "
                          f"float32 routing metadata")
    if drop_policy not in DROP_POLICIES:
        return ValueError(f"unknown drop_policy {drop_policy!r}; use one of "
                          f"{', '.join(DROP_POLICIES)}")
    if capacity_factor is not None and not capacity_factor > 0:
        return ValueError(f"capacity_factor must be positive (or None for no cap), "
                          f"got {capacity_factor!r}")
    if hierarchical and not two_hop:
        return ValueError(
            "hierarchical=True is not available in the JAX Dispatcher: its exchange is "
            "one padded all-to-all moving the same chunk between every pair of ranks, so "
            "a two-hop route has no duplicate rows to save; pass hierarchical=False (the "
            "core and torch Dispatchers have the deduplicated two-hop path)")
    if hierarchical and not comm.topology.is_uniform:
        return ValueError("two-hop dispatch needs the same number of ranks on every node")
    if max_tokens_per_rank is not None and (
            isinstance(max_tokens_per_rank, bool)
            or not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank < 1):
        return ValueError(f"max_tokens_per_rank must be a positive integer (the most "
                          f"tokens any rank dispatches at once) or None, got "
                          f"{max_tokens_per_rank!r}")
    return chunks_problem(pipeline_chunks, hierarchical, two_hop)


def chunks_problem(chunks: Any, hierarchical: Any,
                   two_hop: bool = True) -> Optional[ValueError]:
    """What is wrong with a ``pipeline_chunks`` option (None: nothing): a
    count above 1 pipelines a two-hop dispatch's inter-node hop, so it is
    refused, not ignored, where there is no such hop."""
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        return ValueError(f"pipeline_chunks must be a positive integer (the chunks a two-hop "
                          f"dispatch cuts its inter-node hop into; 1: no pipelining) or None "
                          f"(chosen from the bytes), got {chunks!r}")
    if chunks is not None and chunks > 1 and not two_hop:
        return ValueError(f"pipeline_chunks={chunks} is not available in the JAX Dispatcher: "
                          f"it cuts a two-hop dispatch's inter-node hop into chunks, and the "
                          f"JAX exchange is one padded all-to-all; pass pipeline_chunks=None "
                          f"or 1 (XLA schedules the one exchange against other work)")
    if chunks is not None and chunks > 1 and not hierarchical:
        return ValueError(f"pipeline_chunks={chunks} cuts a two-hop dispatch's inter-node hop "
                          f"into chunks, and flat dispatch (hierarchical=False) has one hop: "
                          f"pass hierarchical=True, or pipeline_chunks=None or 1")
    return None


def placement_problem(comm, num_experts: Any, placement: Any) -> Optional[ValueError]:
    """What is wrong with ``num_experts`` and a Dispatcher's ``placement``
    (not None) on this rank (None: nothing): router ids are logical, so ``num_experts``
    must be the placement's ``num_logical``, and its slots must be this
    world's ranks."""
    if not isinstance(placement, Placement):
        return ValueError(f"placement must be a commlib.moe.Placement or None, got "
                          f"{type(placement).__name__}")
    if isinstance(num_experts, bool) or num_experts != placement.num_logical:
        return ValueError(f"num_experts={num_experts!r} must equal the placement's num_logical "
                          f"({placement.num_logical}): router ids are logical experts")
    if placement.ranks != comm.size:
        return ValueError(f"the placement is for {placement.ranks} ranks, but the world size "
                          f"is {comm.size}")
    return None


def slot_count(num_experts: int, placement: Optional[Placement]) -> int:
    """The experts a Dispatcher lays out on its ranks: the placement's
    physical slots, or the ``num_experts`` experts themselves."""
    return num_experts if placement is None else placement.num_physical


def placement_fingerprint(placement: Optional[Placement]) -> str:
    """What the ranks compare to agree on a placement: its sizes and a
    digest of its table (the same placement gives the same text everywhere)."""
    if placement is None:
        return "placement=None"
    digest = hashlib.sha256(placement.physical_to_logical.tobytes()).hexdigest()[:16]
    return (f"placement of {placement.num_logical} experts on {placement.ranks} ranks in "
            f"{placement.nodes} nodes, table {digest}")


def agree_options(comm, num_experts: Any, capacity_factor: Any, drop_policy: Any,
                  hierarchical: Any, max_tokens_per_rank: Any, pipeline_chunks: Any,
                  two_hop: bool = True, placement: Any = None) -> None:
    """A Dispatcher's options checked and agreed on by every rank: the same
    everywhere (the placement too, by ``placement_fingerprint``), or
    ``CollectiveMismatchError`` on every rank naming the rank and what was
    wrong."""
    problem = options_problem(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                              max_tokens_per_rank, pipeline_chunks, two_hop, placement)
    named = dict(num_experts=num_experts, capacity_factor=capacity_factor,
                 drop_policy=drop_policy, hierarchical=hierarchical,
                 max_tokens_per_rank=max_tokens_per_rank, pipeline_chunks=pipeline_chunks)
    facts = () if problem else tuple(f"{name}={value!r}" for name, value in named.items()) \
        + (placement_fingerprint(placement),)
    comm.agree("moe.Dispatcher", *facts, problem=problem)


def capacity(tokens: int, k: int, num_experts: int, capacity_factor: Optional[float],
             max_tokens_per_rank: Optional[int]) -> Optional[int]:
    """Assignments each expert takes from one rank,
    ``ceil(T * k / E * capacity_factor)``, T at most ``max_tokens_per_rank``
    (None: no capacity factor, no cap)."""
    if capacity_factor is None:
        return None
    if max_tokens_per_rank is not None:
        tokens = min(tokens, max_tokens_per_rank)
    return math.ceil(tokens * k / num_experts * capacity_factor)


def require_one_place(named: List[Tuple[str, Any]]) -> None:
    """Raise ValueError unless the arrays are of one framework, on one
    device: commlib computes where the data lives and never moves it.
    NumPy arrays, or torch tensors on one device, pass without asking the
    array API helpers (at decode sizes every call shows; issue 37)."""
    kind = type(named[0][1])
    if all(type(a) is kind for _, a in named):
        if kind is np.ndarray:
            return
        if kind.__module__.startswith("torch") and hasattr(named[0][1], "is_sparse"):
            where = named[0][1].device
            if all(a.device == where for _, a in named):
                return
    places = [(framework(a), str(device(a))) for _, a in named]
    if len(set(places)) > 1:
        found = ", ".join(f"{name} {kind} on {where}" for (name, _), (kind, where)
                          in zip(named, places))
        raise ValueError(f"{found}: pass arrays of one framework on one device "
                         f"(convert the odd one out first)")


def input_problem(x: Any, experts: Any, weights: Any,
                  quantize: Optional[str]) -> Optional[Exception]:
    """What is wrong with the shapes and kinds of a dispatch's input on this
    rank (None: nothing); the ids' values are ``range_problem``'s."""
    named = [("x", x), ("experts", experts), ("weights", weights)]
    try:
        for name, a in named:
            framework_of(name, a)
        require_one_place(named)
        if x.ndim < 2:
            raise ValueError(f"x must be [tokens, hidden] (a row per token; more trailing axes "
                             f"are one row's shape), got shape {tuple(x.shape)}")
        tokens = x.shape[0]
        if experts.ndim != 2 or experts.shape[0] != tokens:
            raise ValueError(f"experts must be [tokens, k] with {tokens} rows like x, got "
                             f"shape {tuple(experts.shape)}")
        if tuple(weights.shape) != tuple(experts.shape):
            raise ValueError(f"weights must have the shape of experts "
                             f"{tuple(experts.shape)}, got {tuple(weights.shape)}")
        if not dtype_name(experts).startswith(("int", "uint")):
            raise ValueError(f"experts must be integers, got {dtype_name(experts)}")
        if quantize not in QUANTIZE:
            raise ValueError(f"unknown quantize={quantize!r}; use None (rows travel in "
                             f"x's dtype) or 'fp8' (e4m3 with a scale per 128 channels)")
        if quantize == "fp8" and x.ndim != 2:
            raise ValueError(f"quantize='fp8' takes x of shape [tokens, hidden], got "
                             f"{tuple(x.shape)}")
        if quantize == "fp8":
            quantize_fp8(x[:0])  # the framework's and dtype's refusals, on no data
    except (ValueError, TypeError) as error:
        return error
    return None


def range_problem(num_experts: int, low: int, high: int) -> Optional[ValueError]:
    """Expert ids outside [-1, E), from their smallest and largest value."""
    if low < -1 or high >= num_experts:
        return ValueError(f"expert indices must lie in [-1, {num_experts}) "
                          f"(-1: no expert), got values from {low} to {high}")
    return None


def combine_problem(expert_y: Any, lead: Tuple[int, ...], like: Any) -> Optional[Exception]:
    """What is wrong with ``expert_y`` for a dispatch whose ``expert_x`` had
    the leading shape ``lead`` and whose arrays are beside ``like``."""
    try:
        framework_of("expert_y", expert_y)
        require_one_place([("expert_y", expert_y), ("the dispatch's arrays", like)])
    except ValueError as error:
        return error
    if tuple(expert_y.shape[:len(lead)]) != tuple(lead):
        return ValueError(f"expert_y must have one row per expert_x row (leading shape "
                          f"{tuple(lead)}), got shape {tuple(expert_y.shape)}")
    return None
