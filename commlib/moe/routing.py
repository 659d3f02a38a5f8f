"""Top-k expert routing: which experts each token goes to, and with what weight.

The gate follows DeepSeek-V3 (arXiv:2412.19437, section 2.1.2, and the
``Gate`` of their published ``inference/model.py``):

1. affinities ``s``: softmax over all experts, or an element-wise sigmoid;
2. ``s + bias`` is used to *choose* experts only; the weights come from the
   unbiased ``s``, so a load-balancing bias (``BiasBalancer``) steers tokens
   without distorting what the experts' outputs are multiplied by;
3. group-limited routing: the experts form ``num_groups`` contiguous groups
   (one per node, say); a group scores the sum of its best
   ``max(1, k // topk_groups)`` biased affinities, only the ``topk_groups``
   best groups are eligible, and the top-k is taken among their experts. A
   token then reaches at most ``topk_groups`` nodes, which bounds its
   all-to-all traffic;
4. ``normalize``: the chosen weights are scaled to sum to one.

Every choice breaks ties towards the lower index (expert or group), so the
routing is a function of its inputs alone, the same on every rank and device.
Everything is computed in float32, once, in the logits' own framework and on
their device (torch ops for a torch tensor, ``jax.numpy`` for a JAX array),
bfloat16 logits included.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

import array_api_extra as xpx
import numpy as np

from ..namespace import (
    check_int,
    device,
    dtype_name,
    float32,
    framework,
    index_dtype,
    is_traced,
    namespace,
    to_host,
)

SCORES = ("softmax", "sigmoid")


def route(logits: Any, k: int, score: str = "softmax", bias: Any = None,
          num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
          normalize: bool = True) -> Tuple[Any, Any]:
    """Choose ``k`` experts per token from router ``logits`` [tokens, experts].

    Returns ``(experts, weights)``, both [tokens, k], in the caller's
    framework and on its device: experts as int64 (int32 under JAX without
    x64), sorted by descending biased score within a row; weights as
    float32. ``bias`` [experts] shifts the selection only; a bias of
    another framework (the balancer's NumPy bias) is copied beside the
    logits. See the module docstring for the algorithm.
    """
    num_experts = _check_shape(logits)
    k = _check_k(k, num_experts)
    _check_score(score)
    _check_groups(num_groups, topk_groups, k, num_experts)
    x = _float32(logits, "logits")
    try:  # raised after the logits' own check, as always; both values read in one copy
        (shift, bias_finite), late = _bias(bias, num_experts, x), None
    except (TypeError, ValueError) as error:
        (shift, bias_finite), late = (None, True), error
    _check_finite(x, shift if bias_finite is None else None, late, bias_finite)

    xp = namespace(x)
    affinity = _affinities(x, score)
    biased = affinity if shift is None else affinity + shift
    if num_groups is not None:
        biased = _mask_groups(biased, num_groups, topk_groups, k)
    experts = _top(biased, k)
    if normalize:
        weights = _normalized_weights(xp.take_along_axis(x, experts, axis=1), score)
    else:
        weights = xp.take_along_axis(affinity, experts, axis=1)
    return experts, weights


def _as_int(name: str, value: Any) -> int:
    """Integers only (Python or NumPy); 2.0 experts is a bug, not a request."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_shape(logits: Any) -> int:
    """Logits are [tokens, experts]; returns the number of experts."""
    framework(logits)  # a clear TypeError for lists and other non-arrays
    if logits.ndim != 2:
        raise ValueError(f"logits must be 2-D [tokens, experts], got shape "
                         f"{tuple(logits.shape)}; flatten the leading dimensions first "
                         f"(logits.reshape(-1, num_experts))")
    return int(logits.shape[1])


def _check_k(k: Any, num_experts: int) -> int:
    k = _as_int("k", k)
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k} experts per token is impossible with {num_experts} experts; "
                         f"choose k between 1 and {num_experts}")
    return k


def _check_score(score: Any) -> None:
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; use one of {', '.join(map(repr, SCORES))}")


def _check_groups(num_groups: Any, topk_groups: Any, k: int, num_experts: int) -> None:
    """Group-limited routing needs both numbers, groups of equal size, and
    enough experts in the eligible groups to pick ``k`` from."""
    if num_groups is None:
        if topk_groups is not None:
            raise ValueError(f"topk_groups={topk_groups} was given without num_groups; "
                             f"pass num_groups (how many groups the experts form) as well, "
                             f"or neither for plain top-k")
        return
    num_groups = _as_int("num_groups", num_groups)
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide num_experts={num_experts} "
                         f"into equal groups; use a divisor of {num_experts}")
    if topk_groups is None:
        raise ValueError(f"num_groups={num_groups} was given without topk_groups; pass "
                         f"topk_groups (how many groups each token may use, 1..{num_groups})")
    topk_groups = _as_int("topk_groups", topk_groups)
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be between 1 and "
                         f"num_groups={num_groups}")
    eligible = topk_groups * (num_experts // num_groups)
    if k > eligible:
        raise ValueError(f"k={k} exceeds the {eligible} experts in topk_groups={topk_groups} "
                         f"groups of {num_experts // num_groups}; raise topk_groups to at least "
                         f"{-(-k // (num_experts // num_groups))} or lower k")


def _float32(a: Any, what: str) -> Any:
    """``a`` as float32, in its own framework (bfloat16 widens exactly)."""
    if dtype_name(a).startswith("complex"):
        raise ValueError(f"{what} must be real, got {dtype_name(a)}")
    return float32(a)


def _check_finite(x: Any, shift: Optional[Any], late: Optional[Exception],
                  bias_finite: Optional[bool]) -> None:
    """A NaN or inf logit makes every affinity of its row meaningless; a
    NaN or inf bias every choice. One integer says how many rows of logits
    are bad and whether ``shift`` (a bias beside the logits, not yet
    checked) is: 2 * bad rows + bad bias, checked by ``check_int`` (one
    copy to the host; under ``jax.jit`` a check that runs in the program).
    The errors come in their usual order: the logits, ``late`` (what was
    wrong with the bias's type or shape), the bias's values (``bias_finite``
    False: seen on the host already). Under ``jit`` ``late`` is raised while
    tracing: it does not depend on values."""
    xp = namespace(x)
    kind = index_dtype(x)
    seen = 2 * xp.astype(xp.count_nonzero(~xp.all(xp.isfinite(x), axis=1)), kind)
    if shift is not None:
        seen = seen + xp.astype(xp.any(~xp.isfinite(shift)), kind)
    if late is not None and is_traced(seen):
        raise late
    rows = x.shape[0]

    def verdict(code: int) -> None:
        bad_rows, bad_bias = divmod(code, 2)
        if bad_rows:
            raise ValueError(f"logits have NaN or inf values in {bad_rows} of {rows} rows "
                             f"(tokens); check the router's input and weights for overflow")
        if late is not None:
            raise late
        if bias_finite is False or bad_bias:
            raise ValueError("bias has NaN or inf values; reset the balancer's bias to zeros")
    check_int(seen, verdict)


def _bias(bias: Any, num_experts: int, like: Any) -> Tuple[Optional[Any], Optional[bool]]:
    """The selection bias as float32 [E] beside ``like`` (the logits), or
    None; and whether its values are finite where that was seen on the host
    (None: not yet seen, ``_check_finite`` looks on the device). A bias of
    another framework (the balancer's NumPy bias for torch CUDA logits, say)
    is checked on the host and copied over: E numbers. (A host bias is
    uploaded on every call; pass one already beside the logits to save
    that copy.)"""
    if bias is None:
        return None, True
    framework(bias)  # a clear TypeError for lists and other non-arrays
    if tuple(bias.shape) != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},), one value per expert, "
                         f"got {tuple(bias.shape)}")
    shift = _float32(bias, "bias")
    xp = namespace(like)
    if framework(shift) == framework(like):  # moved only if on another device
        return xp.asarray(shift, device=device(like)), None
    host = shift if framework(shift) == "numpy" else to_host(shift)
    return xp.asarray(host, device=device(like)), bool(np.isfinite(host).all())


def _affinities(x: Any, score: str) -> Any:
    """Softmax or sigmoid of the logits, without overflow for any finite
    logit (the sigmoid through ``exp(-|x|)``, which is at most 1)."""
    xp = namespace(x)
    if score == "softmax":
        exp = xp.exp(x - xp.max(x, axis=1, keepdims=True))
        return exp / xp.sum(exp, axis=1, keepdims=True)
    small = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1.0, small) / (1 + small)


def _top(scores: Any, k: int) -> Any:
    """Indices of the ``k`` largest entries of each row, largest first, ties
    to the lower index. Repeated argmax (the first maximum, in every
    framework), each pick knocked out for the next: in place on a copy where
    the framework allows, functionally under JAX (array-api-extra's ``at``)."""
    xp = namespace(scores)
    rows = xp.arange(scores.shape[0], device=device(scores))
    work, picks = xp.asarray(scores, copy=True), []
    for pick in range(k):
        best = xp.argmax(work, axis=1)
        picks.append(best)
        if pick + 1 < k:
            work = xpx.at(work)[rows, best].set(-xp.inf)
    return xp.astype(xp.stack(picks, axis=1), index_dtype(scores), copy=False)


def _mask_groups(biased: Any, num_groups: int, topk_groups: int, k: int) -> Any:
    """``biased`` with the experts outside each row's ``topk_groups`` best
    groups set to -inf, so the top-k cannot pick them."""
    xp = namespace(biased)
    tokens, num_experts = biased.shape
    group_size = num_experts // num_groups
    per_group = xp.reshape(biased, (tokens * num_groups, group_size))
    best = xp.take_along_axis(per_group, _top(per_group, max(1, k // topk_groups)), axis=1)
    group_scores = xp.reshape(xp.sum(best, axis=1), (tokens, num_groups))
    kept = _top(group_scores, topk_groups)
    groups = xp.arange(num_groups, device=device(biased))
    eligible = xp.any(kept[:, :, None] == groups, axis=1)  # [tokens, groups]
    masked = xp.where(eligible[:, :, None],
                      xp.reshape(biased, (tokens, num_groups, group_size)), -xp.inf)
    return xp.reshape(masked, (tokens, num_experts))


def _normalized_weights(chosen: Any, score: str) -> Any:
    """Weights summing to one from the chosen experts' logits: a softmax over
    their log affinities, which equals dividing the affinities by their sum
    but cannot divide 0 by 0 when they all underflow. Under a softmax score
    the log affinity is the logit up to a per-row constant, which cancels."""
    xp = namespace(chosen)
    if score == "sigmoid":  # log sigmoid
        chosen = -(xp.clip(-chosen, min=0) + xp.log1p(xp.exp(-xp.abs(chosen))))
    exp = xp.exp(chosen - xp.max(chosen, axis=1, keepdims=True))
    return exp / xp.sum(exp, axis=1, keepdims=True)
