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


def _weights(lse: Any, block_lse: Any, xp) -> Tuple[Any, Any, Any]:
    """(weight of the old rows, weight of the block's rows, merged lse);
    weights as [b, s, h, 1] to scale rows of [b, s, h, d]."""
    lse = lse.astype(xp.float32, copy=False)
    block_lse = block_lse.astype(xp.float32, copy=False)
    top = xp.maximum(lse, block_lse)
    empty = xp.isneginf(top)  # neither side saw a key
    base = xp.where(empty, xp.float32(0), top)
    keep = xp.exp(lse - base)  # one of keep, take is exp(0) = 1 unless empty
    take = xp.exp(block_lse - base)
    denominator = xp.where(empty, xp.float32(1), keep + take)
    new_lse = xp.where(empty, xp.float32(-xp.inf), base + xp.log(denominator))
    as_rows = (0, 2, 1)  # [b, h, s] -> [b, s, h]
    return (xp.transpose(keep / denominator, as_rows)[..., None],
            xp.transpose(take / denominator, as_rows)[..., None], new_lse)


def merge(out: Any, lse: Any, block_out: Any, block_lse: Any) -> Tuple[Any, Any]:
    """Online-softmax step. ``out``/``block_out``: [batch, seq, heads, dim];
    ``lse``/``block_lse``: [batch, heads, seq] float32. Returns new float32
    ``(out, lse)``; the inputs are not modified."""
    xp = namespace_of(out)
    weight_old, weight_new, new_lse = _weights(lse, block_lse, xp)
    merged = out.astype(xp.float32) * weight_old
    merged += block_out.astype(xp.float32, copy=False) * weight_new
    return merged, new_lse


def merge_into(out: Any, lse: Any, block_out: Any, block_lse: Any) -> None:
    """``merge`` in place, into float32 ``out`` and ``lse`` (which may be
    views): the ring's running result, without another copy of it."""
    xp = namespace_of(out)
    weight_old, weight_new, new_lse = _weights(lse, block_lse, xp)
    out *= weight_old
    out += block_out.astype(xp.float32, copy=False) * weight_new
    lse[...] = new_lse
