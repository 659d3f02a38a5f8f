"""Blockwise attention on one rank, for NumPy and CuPy: the local kernel of
Ring Attention (and of Ulysses, after its relayout).

Flash-attention's schedule in array code: queries in tiles, keys in tiles,
an online softmax per query tile, so that at most one tile of scores
([batch, kv_heads, group * tile, tile] float32) exists at a time, never the
full [seq, seq] matrix. GQA without copies: query heads are grouped under
their kv head (query head i uses kv head i // group), so one batched matmul
per kv head serves the whole group, and the backward pass sums dK and dV
over the group by construction. Statistics and accumulators are float32
whatever the input dtype.

``causal`` here means the flash-attention convention for equal query and key
lengths: query i sees keys 0..i of the same block.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from .merge import namespace_of

# a tile of scores ([batch, heads, tile, tile] float32) is kept about this
# size: larger tiles fall out of cache and slow the element-wise softmax work
# (measured: 8 heads, 256 beats 512 by 6%; 16 heads by 20%)
SCORE_TILE_BYTES = 4 * 2**20


def choose_tile(batch: int, heads: int) -> int:
    """The tile edge, a power of two from 64 to 1024, that keeps a score
    tile near SCORE_TILE_BYTES."""
    edge = math.isqrt(max(SCORE_TILE_BYTES // (4 * batch * heads), 1))
    return max(64, min(1024, 1 << (edge.bit_length() - 1)))


def _as_float32(x, xp):
    return x.astype(xp.float32, copy=False)


def _grouped(x, kv_heads: int, xp):
    """[b, t, h, d] -> [b, kv_heads, group * t, d] float32 (a tile-sized copy)."""
    b, t, h, d = x.shape
    group = h // kv_heads
    return _as_float32(x.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4), xp) \
        .reshape(b, kv_heads, group * t, d)


def _ungrouped(y, t: int):
    """[b, kv_heads, group * t, d] -> [b, t, heads, d]."""
    b, kv_heads, rows, d = y.shape
    group = rows // t
    return y.reshape(b, kv_heads, group, t, d).transpose(0, 3, 1, 2, 4) \
        .reshape(b, t, kv_heads * group, d)


def _rows_to_heads(stat, t: int):
    """Per-row statistics [b, kv_heads, group * t] -> [b, heads, t]."""
    b, kv_heads, rows = stat.shape
    return stat.reshape(b, kv_heads * (rows // t), t)


def _heads_to_rows(stat, kv_heads: int):
    """[b, heads, t] -> [b, kv_heads, group * t]."""
    b, heads, t = stat.shape
    return stat.reshape(b, kv_heads, (heads // kv_heads) * t)


def _causal_mask(xp, q_start: int, q_len: int, k_start: int, k_len: int, group: int):
    """True where a key comes after the query: [group * q_len, k_len]."""
    later = (k_start + xp.arange(k_len))[None, :] > (q_start + xp.arange(q_len))[:, None]
    return xp.tile(later, (group, 1))


def _key_tiles(q_start: int, q_end: int, k_len: int, causal: bool, tile: int):
    """(start, end, needs_mask) of each key tile a query tile must visit;
    under the causal mask tiles wholly after the queries are skipped."""
    end = min(q_end, k_len) if causal else k_len
    for start in range(0, end, tile):
        stop = min(start + tile, end)
        yield start, stop, causal and stop - 1 > q_start


def _check(q, k, causal: bool) -> None:
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"the causal block kernel needs as many queries as keys "
                         f"({q.shape[1]} vs {k.shape[1]})")


def attention_forward(q: Any, k: Any, v: Any, causal: bool = False,
                      softmax_scale: Optional[float] = None,
                      tile: Optional[int] = None) -> Tuple[Any, Any]:
    """softmax(scale * q k^T) v for q [b, sq, h, d], k and v [b, sk, hk, d].
    Returns ``(out, lse)``: out [b, sq, h, d] and lse [b, h, sq], float32."""
    _check(q, k, causal)
    xp = namespace_of(q)
    b, sq, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    tile = tile or choose_tile(b, heads)
    out = xp.empty((b, sq, heads, d), dtype=xp.float32)
    lse = xp.empty((b, heads, sq), dtype=xp.float32)
    for q0 in range(0, sq, tile):
        q1 = min(q0 + tile, sq)
        qt = _grouped(q[:, q0:q1], kv_heads, xp) * xp.float32(scale)
        rows = qt.shape[2]
        top = xp.full((b, kv_heads, rows), -xp.inf, dtype=xp.float32)
        total = xp.zeros((b, kv_heads, rows), dtype=xp.float32)
        acc = xp.zeros((b, kv_heads, rows, d), dtype=xp.float32)
        for k0, k1, masked in _key_tiles(q0, q1, k.shape[1], causal, tile):
            scores = qt @ _as_float32(k[:, k0:k1].transpose(0, 2, 3, 1), xp)
            if masked:
                scores[..., _causal_mask(xp, q0, q1 - q0, k0, k1 - k0, group)] = -xp.inf
            new_top = xp.maximum(top, scores.max(axis=-1))
            base = xp.where(xp.isneginf(new_top), xp.float32(0), new_top)
            scores -= base[..., None]
            probs = xp.exp(scores, out=scores)
            rescale = xp.exp(top - base)
            total = total * rescale + probs.sum(axis=-1)
            acc = acc * rescale[..., None] + probs @ _as_float32(
                v[:, k0:k1].transpose(0, 2, 1, 3), xp)
            top = new_top
        empty = total == 0
        denominator = xp.where(empty, xp.float32(1), total)
        out[:, q0:q1] = _ungrouped(acc / denominator[..., None], q1 - q0)
        base = xp.where(xp.isneginf(top), xp.float32(0), top)
        lse[:, :, q0:q1] = _rows_to_heads(
            xp.where(empty, xp.float32(-xp.inf), base + xp.log(denominator)), q1 - q0)
    return out, lse


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                       causal: bool = False, softmax_scale: Optional[float] = None,
                       delta: Any = None, tile: Optional[int] = None) -> Tuple[Any, Any, Any]:
    """Gradients of ``attention_forward`` (dq, dk, dv; float32, shaped like
    q, k, v). ``lse`` [b, h, sq] may be the log-sum-exp over *more* keys than
    ``k`` holds (Ring Attention passes the global one): then these are this
    block's exact contributions. ``delta`` = rowsum(dout * out) [b, h, sq]
    is computed when not given."""
    _check(q, k, causal)
    xp = namespace_of(q)
    b, sq, heads, d = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = xp.float32(softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d))
    tile = tile or choose_tile(b, heads)
    if delta is None:
        delta = row_dot(dout, out)
    dq = xp.empty((b, sq, heads, d), dtype=xp.float32)
    dk = xp.zeros((b, kv_heads, k.shape[1], d), dtype=xp.float32)
    dv = xp.zeros((b, kv_heads, k.shape[1], d), dtype=xp.float32)
    for q0 in range(0, sq, tile):
        q1 = min(q0 + tile, sq)
        qt = _grouped(q[:, q0:q1], kv_heads, xp)
        dot = _grouped(dout[:, q0:q1], kv_heads, xp)
        row_lse = _heads_to_rows(lse[:, :, q0:q1], kv_heads)
        row_lse = xp.where(xp.isneginf(row_lse), xp.float32(xp.inf), row_lse)[..., None]
        row_delta = _heads_to_rows(delta[:, :, q0:q1], kv_heads)[..., None]
        dqt = xp.zeros_like(qt)
        for k0, k1, masked in _key_tiles(q0, q1, k.shape[1], causal, tile):
            kt = _as_float32(k[:, k0:k1].transpose(0, 2, 1, 3), xp)   # [b, hk, tk, d]
            vt = _as_float32(v[:, k0:k1].transpose(0, 2, 1, 3), xp)
            scores = (qt @ kt.transpose(0, 1, 3, 2)) * scale
            if masked:
                scores[..., _causal_mask(xp, q0, q1 - q0, k0, k1 - k0, group)] = -xp.inf
            scores -= row_lse
            probs = xp.exp(scores, out=scores)                        # this block's P
            dv[:, :, k0:k1] += probs.transpose(0, 1, 3, 2) @ dot
            dscores = (dot @ vt.transpose(0, 1, 3, 2) - row_delta) * probs * scale
            dqt += dscores @ kt
            dk[:, :, k0:k1] += dscores.transpose(0, 1, 3, 2) @ qt
        dq[:, q0:q1] = _ungrouped(dqt, q1 - q0)
    return dq, dk.transpose(0, 2, 1, 3), dv.transpose(0, 2, 1, 3)


def row_dot(dout: Any, out: Any) -> Any:
    """rowsum(dout * out) as [b, h, s] float32: the D of flash-attention's
    backward pass."""
    xp = namespace_of(dout)
    product = _as_float32(dout, xp) * _as_float32(out, xp)
    return xp.ascontiguousarray(product.sum(axis=-1).transpose(0, 2, 1))
