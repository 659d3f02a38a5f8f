"""Decode and chunk attention over a sharded latent cache: multi-head latent
attention's absorbed form (DeepSeek-V2's inference).

Each rank caches its tokens' latents c [r] and rotary keys k_rope [d_rope]
(576 values a token a layer at DeepSeek-V3's sizes, against 40,960 for
expanded heads). Head h's score of a cached token is
q_nope_h . (W_UK_h^T c) + q_rope_h . k_rope = (W_UK_h q_nope_h) . c + q_rope_h . k_rope:
with the query multiplied into W_UK, every head attends to the same
[c, k_rope] (one shared key head of r + d_rope values) and reads the same
c as its value, so decode is ``decode_attention`` with one KV head over the
latent, its partials merged by log-sum-exp across ranks as ever, and a
later turn's chunk is ``chunk_attention`` alike; each head's latent output
is then multiplied by W_UV_h. The cache keeps [c, k_rope] once a token
(``latent_keys``); the value is a view of its first r columns. The scores are the
expanded form's, so the scale (the original head size's), windows, sinks
and the soft-cap carry over unchanged."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ..namespace import namespace
from ..sequence.attention_call import scale_of
from .attention import chunk_attention, decode_attention

__all__ = ["latent_decode_attention", "latent_chunk_attention", "latent_keys"]


def latent_keys(latent: Any, rope_k: Any) -> Any:
    """What a latent cache keeps of each token, [b, n, 1, r + d_rope]: its
    latent ``latent`` [b, n, r] then its rotary key ``rope_k`` [b, n,
    d_rope], one "key head" every query head attends to, whose first r
    columns are also the value (so the cache holds them once)."""
    xp = namespace(latent)
    return xp.concat([latent, rope_k], axis=-1)[:, :, None]


def absorbed_query(q: Any, w_uk: Any) -> Any:
    """q [b, t, h, d_nope + d_rope] as the latent space's query [b, t, h,
    r + d_rope]: its nope part multiplied into ``w_uk`` [r, h, d_nope]."""
    xp = namespace(q)
    r, heads, nope = w_uk.shape
    q_nope = xp.permute_dims(q[..., :nope], (2, 0, 1, 3))        # [h, b, t, n]
    weights = xp.permute_dims(w_uk, (1, 2, 0))                   # [h, n, r]
    b, t = q.shape[:2]
    latent_q = xp.matmul(xp.reshape(q_nope, (heads, b * t, nope)), weights)  # [h, b t, r]
    latent_q = xp.permute_dims(xp.reshape(latent_q, (heads, b, t, r)), (1, 2, 0, 3))
    return xp.concat([latent_q, q[..., nope:]], axis=-1)


def _absorbed(attend: Callable[..., Any], q: Any, keys: Any, w_uk: Any, w_uv: Any,
              softmax_scale: Optional[float], **options: Any) -> Any:
    """``attend`` (decode or chunk attention) in the latent space: the query
    absorbed into W_UK, over ``keys`` [b, n, 1, r + d_rope] with their
    first r columns as the value (a view), each head's latent output then
    multiplied by W_UV."""
    xp = namespace(q)
    r, heads, value = w_uv.shape
    out = attend(absorbed_query(q, w_uk), keys, keys[..., :r],
                 softmax_scale=scale_of(q, softmax_scale), **options)
    b, t = out.shape[:2]
    per_head = xp.reshape(xp.permute_dims(out, (2, 0, 1, 3)), (heads, b * t, r))
    expanded = xp.matmul(per_head, xp.permute_dims(w_uv, (1, 0, 2)))   # [h, b t, d_v]
    return xp.permute_dims(xp.reshape(expanded, (heads, b, t, value)), (1, 2, 0, 3))


def latent_decode_attention(q: Any, keys: Any, w_uk: Any, w_uv: Any, comm, *,
                            q_positions: Sequence[int], k_positions: Sequence[int],
                            causal: bool, window: Any = None,
                            softmax_scale: Optional[float] = None, sinks: Any = None,
                            softcap: Optional[float] = None) -> Any:
    """Attention of new tokens q [b, t, h, d_nope + d_rope] (the same on
    every rank) over this rank's shard of a latent cache, ``keys`` [b, n,
    1, r + d_rope] at ``k_positions`` (``latent_keys``), in the absorbed
    form; out [b, t, h, d_v] (``w_uk`` [r, h, d_nope], ``w_uv`` [r, h,
    d_v]), the same on every rank. The options are ``decode_attention``'s;
    ``softmax_scale`` defaults to 1/sqrt(d_nope + d_rope), the expanded
    form's."""
    return _absorbed(decode_attention, q, keys, w_uk, w_uv, softmax_scale, comm=comm,
                     q_positions=q_positions, k_positions=k_positions, causal=causal,
                     window=window, sinks=sinks, softcap=softcap)


def latent_chunk_attention(q: Any, keys: Any, w_uk: Any, w_uv: Any, comm, *,
                           q_positions: Sequence[int], k_positions: Sequence[int],
                           causal: bool, window: Any = None, method: str = "auto",
                           softmax_scale: Optional[float] = None, sinks: Any = None,
                           softcap: Optional[float] = None) -> Any:
    """``chunk_attention`` (this rank's queries of a new chunk over the
    whole sharded cache) over a latent cache, in the absorbed form: q and
    the result as ``latent_decode_attention``'s, this rank's queries only;
    pass-KV moves the latent keys, pass-Q the absorbed queries."""
    return _absorbed(chunk_attention, q, keys, w_uk, w_uv, softmax_scale, comm=comm,
                     q_positions=q_positions, k_positions=k_positions, causal=causal,
                     window=window, method=method, sinks=sinks, softcap=softcap)
