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
Everything is computed in float32, once, against the array namespace ``xp``
(NumPy on the host, CuPy on the GPU).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Tuple

from ..arrays import Native, unwrap

SCORES = ("softmax", "sigmoid")


def route(logits: Any, k: int, score: str = "softmax", bias: Any = None,
          num_groups: Optional[int] = None, topk_groups: Optional[int] = None,
          normalize: bool = True) -> Tuple[Any, Any]:
    """Choose ``k`` experts per token from router ``logits`` [tokens, experts].

    Returns ``(experts, weights)``, both [tokens, k], in the caller's
    framework: experts as int64, sorted by descending biased score within a
    row; weights as float32. ``bias`` [experts] shifts the selection only.
    See the module docstring for the algorithm.
    """
    native = unwrap(logits)
    xp = native.xp
    num_experts = _check_shape(native.data)
    k = _check_k(k, num_experts)
    _check_score(score)
    _check_groups(num_groups, topk_groups, k, num_experts)
    x = _float32(native, "logits")
    _check_finite_rows(x, xp)
    shift = _bias(bias, num_experts, xp)

    affinity = _affinities(x, score, xp)
    biased = affinity if shift is None else affinity + shift
    if num_groups is not None:
        biased = _mask_groups(biased, num_groups, topk_groups, k, xp)
    experts = _top(biased, k, xp)
    if normalize:
        weights = _normalized_weights(xp.take_along_axis(x, experts, axis=1), score, xp)
    else:
        weights = xp.take_along_axis(affinity, experts, axis=1)
    return native.wrap(experts), native.wrap(weights)


def _as_int(name: str, value: Any) -> int:
    """Integers only (Python or NumPy); 2.0 experts is a bug, not a request."""
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_shape(data: Any) -> int:
    """Logits are [tokens, experts]; returns the number of experts."""
    if data.ndim != 2:
        raise ValueError(f"logits must be 2-D [tokens, experts], got shape {tuple(data.shape)}; "
                         f"flatten the leading dimensions first (logits.reshape(-1, num_experts))")
    return int(data.shape[1])


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


def _float32(native: Native, what: str) -> Any:
    """``native`` as float32 (a copy). bfloat16 on the GPU arrives as its raw
    uint16 bits (CuPy has no bfloat16): its float32 value is those bits
    shifted into the high half of a 32-bit word."""
    xp, data = native.xp, native.data
    if native.dtype.kind == "c":
        raise ValueError(f"{what} must be real, got {native.dtype}")
    if native.dtype == data.dtype:
        return data.astype(xp.float32)
    if native.dtype.name == "bfloat16":
        return (data.astype(xp.uint32) << 16).view(xp.float32)
    raise ValueError(f"{what} of type {native.dtype} on the GPU cannot be read; "
                     f"convert them to float32 or bfloat16 first")


def _check_finite_rows(x: Any, xp: Any) -> None:
    """A NaN or inf logit makes every affinity of its row meaningless."""
    bad_rows = int(xp.count_nonzero(~xp.isfinite(x).all(axis=1)))
    if bad_rows:
        raise ValueError(f"logits have NaN or inf values in {bad_rows} of {x.shape[0]} rows "
                         f"(tokens); check the router's input and weights for overflow")


def _bias(bias: Any, num_experts: int, xp: Any) -> Optional[Any]:
    """The selection bias as float32 [E] in ``xp`` (a host bias is copied to
    the GPU when the logits live there), or None."""
    if bias is None:
        return None
    native = unwrap(bias)
    if tuple(native.data.shape) != (num_experts,):
        raise ValueError(f"bias must have shape ({num_experts},), one value per expert, "
                         f"got {tuple(native.data.shape)}")
    shift = xp.asarray(_float32(native, "bias"))
    if not bool(xp.isfinite(shift).all()):
        raise ValueError("bias has NaN or inf values; reset the balancer's bias to zeros")
    return shift


def _affinities(x: Any, score: str, xp: Any) -> Any:
    """Softmax or sigmoid of the logits, without overflow for any finite
    logit (the sigmoid through ``exp(-|x|)``, which is at most 1)."""
    if score == "softmax":
        exp = xp.exp(x - x.max(axis=1, keepdims=True))
        return exp / exp.sum(axis=1, keepdims=True)
    small = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, xp.float32(1), small) / (1 + small)


def _top(scores: Any, k: int, xp: Any) -> Any:
    """Indices of the ``k`` largest entries of each row, largest first, ties
    to the lower index. Repeated argmax rather than a sort: argmax returns
    the first maximum in NumPy and CuPy alike, while sort stability differs."""
    work = scores.copy()
    rows = xp.arange(work.shape[0])
    picks = []
    for _ in range(k):
        best = xp.argmax(work, axis=1)
        picks.append(best)
        work[rows, best] = -xp.inf
    return xp.stack(picks, axis=1).astype(xp.int64, copy=False)


def _mask_groups(biased: Any, num_groups: int, topk_groups: int, k: int, xp: Any) -> Any:
    """``biased`` with the experts outside each row's ``topk_groups`` best
    groups set to -inf, so the top-k cannot pick them."""
    tokens, num_experts = biased.shape
    group_size = num_experts // num_groups
    per_group = biased.reshape(tokens * num_groups, group_size)
    best = xp.take_along_axis(per_group, _top(per_group, max(1, k // topk_groups), xp), axis=1)
    group_scores = best.sum(axis=1).reshape(tokens, num_groups)
    eligible = xp.zeros((tokens, num_groups), dtype=bool)
    eligible[xp.arange(tokens)[:, None], _top(group_scores, topk_groups, xp)] = True
    return xp.where(xp.repeat(eligible, group_size, axis=1), biased, xp.float32(-xp.inf))


def _normalized_weights(chosen: Any, score: str, xp: Any) -> Any:
    """Weights summing to one from the chosen experts' logits: a softmax over
    their log affinities, which equals dividing the affinities by their sum
    but cannot divide 0 by 0 when they all underflow. Under a softmax score
    the log affinity is the logit up to a per-row constant, which cancels."""
    if score == "sigmoid":
        chosen = -(xp.maximum(-chosen, 0) + xp.log1p(xp.exp(-xp.abs(chosen))))  # log sigmoid
    exp = xp.exp(chosen - chosen.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)
