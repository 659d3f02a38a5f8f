"""The online-softmax merge: combine two partial attention results over
disjoint sets of keys into the result over their union.

If ``o1 = softmax(S1) V1`` with ``lse1 = logsumexp(S1)`` and likewise for
block 2, then over both key sets ``lse = log(exp(lse1) + exp(lse2))`` and
``o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2``. Computed around the larger
of the two lse values, so nothing overflows; a row that saw no key at all
(lse = -inf, e.g. fully masked) contributes nothing, and two such rows merge
to lse = -inf, o = 0, never NaN.
"""

from __future__ import annotations

from typing import Any, Tuple


def namespace_of(array):
    """NumPy or CuPy, whichever ``array`` belongs to."""
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    import numpy
    return numpy


def merge(out: Any, lse: Any, block_out: Any, block_lse: Any) -> Tuple[Any, Any]:
    """Online-softmax step. ``out``/``block_out``: [batch, seq, heads, dim];
    ``lse``/``block_lse``: [batch, heads, seq] float32. Returns new float32
    ``(out, lse)``; the inputs are not modified."""
    xp = namespace_of(out)
    lse = lse.astype(xp.float32, copy=False)
    block_lse = block_lse.astype(xp.float32, copy=False)
    top = xp.maximum(lse, block_lse)
    empty = xp.isneginf(top)  # neither side saw a key
    base = xp.where(empty, xp.float32(0), top)
    keep = xp.exp(lse - base)  # one of keep, take is exp(0) = 1 unless empty
    take = xp.exp(block_lse - base)
    denominator = xp.where(empty, xp.float32(1), keep + take)
    new_lse = xp.where(empty, xp.float32(-xp.inf), base + xp.log(denominator))
    # weights [b, h, s] -> [b, s, h, 1], to scale rows of [b, s, h, d]
    weight_old = xp.transpose(keep / denominator, (0, 2, 1))[..., None]
    weight_new = xp.transpose(take / denominator, (0, 2, 1))[..., None]
    merged = out.astype(xp.float32) * weight_old + block_out.astype(xp.float32) * weight_new
    return merged, new_lse.astype(xp.float32)
