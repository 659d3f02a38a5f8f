"""The online-softmax merge: combine two partial attention results over
disjoint sets of keys into the result over their union.

If ``o1 = softmax(S1) V1`` with ``lse1 = logsumexp(S1)`` and likewise for
block 2, then over both key sets ``lse = log(exp(lse1) + exp(lse2))`` and
``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``. Computed around the larger
of the two lse values, so nothing overflows; a row that saw no key at all
(lse = -inf, e.g. fully masked) contributes nothing, and two such rows merge
to lse = -inf, o = 0, never NaN. Written once over the array API: it runs in
the caller's framework, in the accumulator dtype (float32; float64 for
float64 inputs: ``namespace.accumulator_dtype``).
"""

from __future__ import annotations

import math
from typing import Any, Tuple

from ..namespace import accumulator_dtype, namespace


def merge(out: Any, lse: Any, block_out: Any, block_lse: Any) -> Tuple[Any, Any]:
    """Online-softmax step. ``out``/``block_out``: [batch, seq, heads, dim];
    ``lse``/``block_lse``: [batch, heads, seq]. Returns new ``(out, lse)``
    in their framework and accumulator dtype; the inputs are not modified."""
    xp = namespace(out)
    acc = accumulator_dtype(out, block_out)
    lse = xp.astype(lse, acc, copy=False)
    block_lse = xp.astype(block_lse, acc, copy=False)
    top = xp.maximum(lse, block_lse)
    empty = top == -math.inf  # neither side saw a key
    base = xp.where(empty, 0.0, top)
    keep = xp.exp(lse - base)  # one of keep, take is exp(0) = 1 unless empty
    take = xp.exp(block_lse - base)
    denominator = xp.where(empty, 1.0, keep + take)
    merged_lse = xp.where(empty, -math.inf, base + xp.log(denominator))
    as_rows = (0, 2, 1)  # [b, h, s] -> [b, s, h], to scale rows of [b, s, h, d]
    weight_old = xp.permute_dims(keep / denominator, as_rows)[..., None]
    weight_new = xp.permute_dims(take / denominator, as_rows)[..., None]
    merged = xp.astype(out, acc, copy=False) * weight_old
    merged += xp.astype(block_out, acc, copy=False) * weight_new
    return merged, merged_lse


def merge_all(outs: Any, lses: Any) -> Tuple[Any, Any]:
    """``merge`` of partials stacked on axis 0 (``outs`` [P, batch, seq,
    heads, dim], ``lses`` [P, batch, heads, seq]) in one pass: the same
    operations whatever P, where P - 1 ``merge`` steps run P - 1 times as
    many (a decode step merges every rank's partial: issue 46). A partial
    that saw no key weighs nothing; if none did, lse = -inf and out = 0."""
    xp = namespace(outs)
    acc = accumulator_dtype(outs)
    lses = xp.astype(lses, acc, copy=False)
    top = xp.max(lses, axis=0)
    empty = top == -math.inf
    base = xp.where(empty, 0.0, top)
    weights = xp.exp(lses - base)
    denominator = xp.where(empty, 1.0, xp.sum(weights, axis=0))
    merged_lse = xp.where(empty, -math.inf, base + xp.log(denominator))
    scale = xp.permute_dims(weights / denominator, (0, 1, 3, 2))[..., None]
    return xp.sum(xp.astype(outs, acc, copy=False) * scale, axis=0), merged_lse
