"""Blockwise attention written once over the array API: the block kernel
for NumPy, CuPy and JAX (and torch where no fused kernel serves).

Flash-attention's schedule in array code: queries in tiles, keys in tiles,
an online softmax per query tile, so that at most one tile of scores
([batch, kv_heads, group * tile, tile]) exists at a time, never the
full [seq, seq] matrix. GQA without copies: query heads are grouped under
their kv head (query head i uses kv head i // group), so one batched matmul
per kv head serves the whole group, and the backward pass sums dK and dV
over the group by construction. Scores, statistics and accumulators are
in the accumulator dtype (``namespace.accumulator_dtype``): float32 for
16-bit and float32 inputs, float64 for float64 ones. For 16-bit inputs the
P.V product runs in the input dtype on a GPU (flash-attention's choice), and
JAX multiplies input-dtype operands with float32 accumulation. The causal
mask is a ``where``, never a boolean assignment (which would synchronize a
GPU with its host).

``causal`` means the flash-attention convention for equal query and key
lengths: query i sees keys 0..i of the same block. ``mask`` (bool
[queries, keys], True = visible, in q's framework) hides pairs of packed
documents and sliding windows; a row that sees no key gets out 0 and
lse -inf.

``softcap`` (Gemma2, Grok): every score s, after the scale, becomes
cap * tanh(s / cap) before the softmax (before the masks, which then hide
the capped score); the backward multiplies the scores' gradient by its
derivative, 1 - tanh(s / cap)^2, recomputed from the same scores.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional, Tuple

from ..namespace import accumulator_dtype, device, dtype_name, framework, namespace, on_cuda

# a tile of scores ([batch, heads, tile, tile] float32) is kept about this
# size: on a CPU larger tiles fall out of cache and slow the element-wise
# softmax work (measured: 8 heads, 256 beats 512 by 6%; 16 heads by 20%); a
# GPU wants tiles large enough to fill it with few launches
SCORE_TILE_BYTES = {"host": 4 * 2**20, "cuda": 256 * 2**20}


def choose_tile(batch: int, heads: int, cuda: bool = False) -> int:
    """The tile edge, a power of two from 64 to 1024 (4096 on a GPU), that
    keeps a score tile near SCORE_TILE_BYTES."""
    budget = SCORE_TILE_BYTES["cuda" if cuda else "host"]
    edge = math.isqrt(max(budget // (4 * batch * heads), 1))
    return max(64, min(4096 if cuda else 1024, 1 << (edge.bit_length() - 1)))


def _as(x, dtype, xp):
    return xp.astype(x, dtype, copy=False)


def _product(a, b, dtype, wide, xp):
    """a @ b with operands in ``dtype``, result in ``wide`` (the
    accumulator dtype)."""
    if dtype == wide:
        return xp.matmul(_as(a, wide, xp), _as(b, wide, xp))
    a, b = xp.astype(a, dtype, copy=False), xp.astype(b, dtype, copy=False)
    if framework(a) == "jax":
        return xp.matmul(a, b, preferred_element_type=wide)
    return _as(xp.matmul(a, b), wide, xp)


def _exp_(x, xp):
    """exp of a fresh tile, in place where the framework allows: one
    tile-sized allocation less per tile pair (JAX makes a new array)."""
    kind = framework(x)
    if kind in ("numpy", "cupy"):
        return xp.exp(x, out=x)
    if kind == "torch":
        return x.exp_()
    return xp.exp(x)


def _precisions(x, xp, cuda: bool) -> Tuple[Any, Any]:
    """(dtype of Q.K^T operands, dtype of P.V operands): the input's own
    half precision where the framework multiplies it with float32
    accumulation (JAX) or on a GPU for P.V, the accumulator dtype elsewhere."""
    if dtype_name(x) not in ("float16", "bfloat16"):  # by name: NumPy's float64 equals None
        return accumulator_dtype(x), accumulator_dtype(x)
    low = x.dtype
    if framework(x) == "jax":
        return low, low
    return xp.float32, (low if cuda else xp.float32)


def _grouped(x, kv_heads: int, xp):
    """[b, t, h, d] -> [b, kv_heads, group * t, d] (a tile-sized copy)."""
    b, t, h, d = x.shape
    group = h // kv_heads
    return xp.reshape(xp.permute_dims(xp.reshape(x, (b, t, kv_heads, group, d)),
                                      (0, 2, 3, 1, 4)), (b, kv_heads, group * t, d))


def _ungrouped(y, t: int, xp):
    """[b, kv_heads, group * t, d] -> [b, t, heads, d]."""
    b, kv_heads, rows, d = y.shape
    group = rows // t
    return xp.reshape(xp.permute_dims(xp.reshape(y, (b, kv_heads, group, t, d)),
                                      (0, 3, 1, 2, 4)), (b, t, kv_heads * group, d))


def _rows_to_heads(stat, t: int, xp):
    """Per-row statistics [b, kv_heads, group * t] -> [b, heads, t]."""
    b, kv_heads, rows = stat.shape
    return xp.reshape(stat, (b, kv_heads * (rows // t), t))


def _heads_to_rows(stat, kv_heads: int, xp):
    """[b, heads, t] -> [b, kv_heads, group * t]."""
    b, heads, t = stat.shape
    return xp.reshape(stat, (b, kv_heads, (heads // kv_heads) * t))


def _later(xp, where, q_start: int, q_len: int, k_start: int, k_len: int, group: int):
    """True where a key comes after the query: [group * q_len, k_len]."""
    keys = xp.arange(k_start, k_start + k_len, device=where)
    queries = xp.arange(q_start, q_start + q_len, device=where)
    return xp.tile(keys[None, :] > queries[:, None], (group, 1))


def _hidden(scores, mask, q0: int, q1: int, k0: int, k1: int, group: int, xp):
    """``scores`` with the pairs ``mask`` hides at -inf (rows are grouped:
    the tile's mask repeats once per query head of the group)."""
    if mask is None:
        return scores
    return xp.where(xp.tile(mask[q0:q1, k0:k1], (group, 1)), scores, -math.inf)


def _capped(scores, softcap: Optional[float], xp):
    """(cap * tanh(scores / cap), tanh(scores / cap)) of a fresh score tile;
    (scores, None) without a cap."""
    if softcap is None:
        return scores, None
    squashed = xp.tanh(scores / softcap)
    return squashed * softcap, squashed


def _key_tiles(q_start: int, q_end: int, k_len: int, causal: bool,
               tile: int) -> Iterator[Tuple[int, int, bool]]:
    """(start, end, needs_mask) of each key tile a query tile must visit;
    under the causal mask tiles wholly after the queries are skipped."""
    end = min(q_end, k_len) if causal else k_len
    for start in range(0, end, tile):
        stop = min(start + tile, end)
        yield start, stop, causal and stop - 1 > q_start


def _setup(q, k, causal: bool, softmax_scale: Optional[float], tile: Optional[int],
           cuda: Optional[bool]):
    """Check the block and resolve the settings both directions share:
    (xp, cuda, batch, queries, heads, head_dim, kv_heads, group, scale, tile)."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"the causal block kernel needs as many queries as keys "
                         f"({q.shape[1]} vs {k.shape[1]})")
    cuda = on_cuda(q) if cuda is None else cuda
    b, sq, heads, d = q.shape
    kv_heads = k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    return (namespace(q), cuda, b, sq, heads, d, kv_heads, heads // kv_heads, scale,
            tile or choose_tile(b, heads, cuda))


def _heads_last(x, xp):
    """[b, t, hk, d] -> [b, hk, t, d]."""
    return xp.permute_dims(x, (0, 2, 1, 3))


def attention_forward(q: Any, k: Any, v: Any, causal: bool,
                      softmax_scale: Optional[float] = None, tile: Optional[int] = None,
                      cuda: Optional[bool] = None, mask: Any = None,
                      softcap: Optional[float] = None) -> Tuple[Any, Any]:
    """softmax(scale * q k^T) v for q [b, sq, h, d], k [b, sk, hk, d] and
    v [b, sk, hk, dv] (each score capped at ``softcap`` first, where given),
    in q's framework. Returns ``(out, lse)``: out [b, sq, h, dv] and lse [b, h, sq], both in
    the accumulator dtype. ``cuda`` says where q lives when it cannot
    be asked (inside ``jax.jit``)."""
    xp, cuda, b, sq, heads, d, kv_heads, group, scale, tile = _setup(
        q, k, causal, softmax_scale, tile, cuda)
    score_dtype, value_dtype = _precisions(q, xp, cuda)
    wide = accumulator_dtype(q)
    keys, values = _heads_last(k, xp), _heads_last(v, xp)
    outs, lses = [], []
    for q0 in range(0, sq, tile):
        q1 = min(q0 + tile, sq)
        qt = _as(_grouped(q[:, q0:q1], kv_heads, xp), wide, xp) * scale
        rows = qt.shape[2]
        top = xp.full((b, kv_heads, rows), -math.inf, dtype=wide, device=device(q))
        total = xp.zeros((b, kv_heads, rows), dtype=wide, device=device(q))
        acc = xp.zeros((b, kv_heads, rows, v.shape[-1]), dtype=wide, device=device(q))
        for k0, k1, masked in _key_tiles(q0, q1, k.shape[1], causal, tile):
            scores = _product(qt, xp.permute_dims(keys[:, :, k0:k1], (0, 1, 3, 2)),
                              score_dtype, wide, xp)
            scores, _ = _capped(scores, softcap, xp)
            if masked:
                later = _later(xp, device(q), q0, q1 - q0, k0, k1 - k0, group)
                scores = xp.where(later, -math.inf, scores)
            scores = _hidden(scores, mask, q0, q1, k0, k1, group, xp)
            new_top = xp.maximum(top, xp.max(scores, axis=-1))
            base = xp.where(new_top == -math.inf, 0.0, new_top)
            scores -= base[..., None]
            probs = _exp_(scores, xp)
            rescale = xp.exp(top - base)
            total = total * rescale + xp.sum(probs, axis=-1)
            acc = acc * rescale[..., None] + _product(probs, values[:, :, k0:k1],
                                                      value_dtype, wide, xp)
            top = new_top
        empty = total == 0
        denominator = xp.where(empty, 1.0, total)
        outs.append(_ungrouped(acc / denominator[..., None], q1 - q0, xp))
        base = xp.where(top == -math.inf, 0.0, top)
        lses.append(_rows_to_heads(xp.where(empty, -math.inf, base + xp.log(denominator)),
                                   q1 - q0, xp))
    if not outs:
        return (xp.zeros((b, 0, heads, v.shape[-1]), dtype=wide, device=device(q)),
                xp.zeros((b, heads, 0), dtype=wide, device=device(q)))
    return xp.concat(outs, axis=1), xp.concat(lses, axis=2)


def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                       causal: bool, softmax_scale: Optional[float] = None,
                       tile: Optional[int] = None, cuda: Optional[bool] = None,
                       mask: Any = None, softcap: Optional[float] = None
                       ) -> Tuple[Any, Any, Any]:
    """Gradients of ``attention_forward`` (dq, dk, dv in the accumulator
    dtype, shaped like q, k, v). ``lse`` [b, h, sq] may be the log-sum-exp
    over *more* keys than ``k`` holds (Ring Attention passes the global
    one, and the global ``out``): then these are this block's exact
    contributions."""
    xp, cuda, b, sq, heads, d, kv_heads, group, scale, tile = _setup(
        q, k, causal, softmax_scale, tile, cuda)
    wide = accumulator_dtype(q)
    delta = row_dot(dout, out, wide)
    keys, values = _as(_heads_last(k, xp), wide, xp), _as(_heads_last(v, xp), wide, xp)
    key_tiles = list(range(0, k.shape[1], tile))
    dk = [None] * len(key_tiles)
    dv = [None] * len(key_tiles)
    dqs = []
    for q0 in range(0, sq, tile):
        q1 = min(q0 + tile, sq)
        qt = _as(_grouped(q[:, q0:q1], kv_heads, xp), wide, xp)
        scaled = qt * scale
        dot = _as(_grouped(dout[:, q0:q1], kv_heads, xp), wide, xp)
        row_lse = _as(_heads_to_rows(lse[:, :, q0:q1], kv_heads, xp), wide, xp)
        row_lse = xp.where(row_lse == -math.inf, math.inf, row_lse)[..., None]
        row_delta = _heads_to_rows(delta[:, :, q0:q1], kv_heads, xp)[..., None]
        dqt = xp.zeros(qt.shape, dtype=wide, device=device(q))
        for k0, k1, masked in _key_tiles(q0, q1, k.shape[1], causal, tile):
            kt, vt = keys[:, :, k0:k1], values[:, :, k0:k1]            # [b, hk, tk, d]
            scores, squashed = _capped(xp.matmul(scaled, xp.permute_dims(kt, (0, 1, 3, 2))),
                                       softcap, xp)
            if masked:
                later = _later(xp, device(q), q0, q1 - q0, k0, k1 - k0, group)
                scores = xp.where(later, -math.inf, scores)
            scores = _hidden(scores, mask, q0, q1, k0, k1, group, xp)
            scores -= row_lse
            probs = _exp_(scores, xp)                                  # this block's P
            slot = k0 // tile
            dv_part = xp.matmul(xp.permute_dims(probs, (0, 1, 3, 2)), dot)
            dscores = xp.matmul(dot, xp.permute_dims(vt, (0, 1, 3, 2)))
            dscores -= row_delta
            dscores *= probs
            if squashed is not None:  # d(cap * tanh(s / cap)) / ds
                dscores *= 1 - squashed * squashed
            dscores *= scale
            dqt += xp.matmul(dscores, kt)
            dk_part = xp.matmul(xp.permute_dims(dscores, (0, 1, 3, 2)), qt)
            if dk[slot] is None:
                dk[slot], dv[slot] = dk_part, dv_part
            else:
                dk[slot] += dk_part
                dv[slot] += dv_part
        dqs.append(_ungrouped(dqt, q1 - q0, xp))

    def assemble(parts, like):
        full = [p if p is not None else
                xp.zeros((b, kv_heads, min(start + tile, k.shape[1]) - start, like.shape[-1]),
                         dtype=wide, device=device(q))
                for p, start in zip(parts, key_tiles)]
        if not full:
            return xp.zeros(like.shape, dtype=wide, device=device(q))
        return xp.permute_dims(xp.concat(full, axis=2), (0, 2, 1, 3))
    dq = xp.concat(dqs, axis=1) if dqs else xp.zeros(q.shape, dtype=wide, device=device(q))
    return dq, assemble(dk, k), assemble(dv, v)


def row_dot(dout: Any, out: Any, wide: Any = None) -> Any:
    """rowsum(dout * out) as [b, h, s] in ``wide`` (default: their
    accumulator dtype): the D of flash-attention's backward pass."""
    xp = namespace(dout)
    wide = accumulator_dtype(dout, out) if wide is None else wide
    return xp.permute_dims(xp.sum(_as(dout, wide, xp) * _as(out, wide, xp), axis=-1), (0, 2, 1))
