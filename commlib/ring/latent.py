"""Ring and all-gather attention over a latent: multi-head latent attention
(DeepSeek-V2/V3, Kimi-K2, GLM-4-MoE-lite, LongCat-Flash) with the latent
moved, not the heads.

Every token's keys and values come from one compressed latent c [r] (512
values in DeepSeek-V3) and one rotary key k_rope [d_rope] (64) shared by
every head: for head h, k_h = [c W_UK[:, h], k_rope] and v_h = c W_UV[:, h]
(``expand``). The caller passes the up-projection weights, W_UK
[r, h, d_nope] and W_UV [r, h, d_v]; what travels is [c, k_rope], r + d_rope
values a token, where the expanded heads would be h (d_nope + d_rope + d_v):
576 against 40,960 at DeepSeek-V3's sizes, 71x fewer bytes. Each rank
expands every block it receives, so a rank computes the expansion of the
whole sequence (P times its own shard's): the price of moving 71x less.

The backward carries, one hop behind each block, the gradient with respect
to the block's [c, k_rope] (``contract``), never that of the expanded
heads. The weights' gradients are this rank's share: every rank adds what
its queries' blocks give, and the ranks' shares add up to the gradient
(what a data- or context-parallel gradient all-reduce already does with a
replicated weight, as with the sinks' share, ``kernels.sinks``).

The expansion a rank computes grows with the world: moving the latent
costs about 1.8 r P / S more arithmetic than moving expanded heads (every
rank expands, re-expands and contracts every block: 8P products of a
block by a weight, against 6 of its own shard), 6% at r = 512, P = 2 and
32K tokens. Where bytes are cheap (every rank on one host) that is the
whole difference, so ``method`` "expanded" moves the heads instead: each
rank expands its own shard, the plain ring runs on it, and the gradient is
contracted once, as a model that expands first would (the heads' bytes).
"auto" picks "expanded" on one host and "ring" (the latent) across hosts;
"allgather" gathers the latent once. Everything else is the ring's:
layouts, documents, windows, masks, sinks, the soft-cap, kernels
(``ring.attention``). "sparse", whose exchange picks rows of K and V, is
refused."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..kernels import Kernel
from ..kernels.sinks import with_sink_gradient
from ..namespace import accumulator_dtype, detached, device, namespace
from ..sequence.attention_call import AttentionCall, check_dtype, check_together, prepare
from ..sequence.blockwise import attend, attend_backward, finish
from ..sequence.kv import split
from ..sequence.options import AttentionOptions
from .attention import in_order, reduce_scattered, ring_backward, ring_forward
from .exchange import RingExchange

LATENT_METHODS = ("auto", "ring", "allgather", "expanded")


def expand(latent: Any, rope_k: Any, w_uk: Any, w_uv: Any) -> Tuple[Any, Any]:
    """(k [b, s, h, d_nope + d_rope], v [b, s, h, d_v]) of ``latent`` [b, s, r]
    and ``rope_k`` [b, s, d_rope]: each head's keys are the latent's
    up-projection then the shared rotary key (DeepSeek's order)."""
    xp = namespace(latent)
    b, s, r = latent.shape
    _, heads, nope = w_uk.shape
    flat = xp.reshape(latent, (b * s, r))
    k_nope = xp.reshape(xp.matmul(flat, xp.reshape(w_uk, (r, heads * nope))), (b, s, heads, nope))
    rope = xp.broadcast_to(rope_k[:, :, None, :], (b, s, heads, rope_k.shape[-1]))
    v = xp.reshape(xp.matmul(flat, xp.reshape(w_uv, (r, -1))), (b, s, heads, w_uv.shape[-1]))
    return xp.concat([k_nope, rope], axis=-1), v


def contract(dk: Any, dv: Any, latent: Any, w_uk: Any, w_uv: Any) -> Tuple[Any, Any, Any]:
    """``expand``'s backward for one block: (d[latent, rope_k] [b, s, r +
    d_rope], dW_UK, dW_UV), in dk's (accumulator) dtype."""
    xp = namespace(dk)
    wide = dk.dtype
    b, s, r = latent.shape
    _, heads, nope = w_uk.shape
    dk_nope = xp.reshape(dk[..., :nope], (b * s, heads * nope))
    dv_flat = xp.reshape(dv, (b * s, heads * w_uv.shape[-1]))
    uk = xp.astype(xp.reshape(w_uk, (r, heads * nope)), wide)
    uv = xp.astype(xp.reshape(w_uv, (r, -1)), wide)
    d_latent = xp.matmul(dk_nope, xp.matrix_transpose(uk)) \
        + xp.matmul(dv_flat, xp.matrix_transpose(uv))
    d_rope = xp.sum(dk[..., nope:], axis=2)
    flat = xp.matrix_transpose(xp.astype(xp.reshape(latent, (b * s, r)), wide))
    d_w_uk = xp.reshape(xp.matmul(flat, dk_nope), w_uk.shape)
    d_w_uv = xp.reshape(xp.matmul(flat, dv_flat), w_uv.shape)
    return xp.concat([xp.reshape(d_latent, (b, s, r)), d_rope], axis=-1), d_w_uk, d_w_uv


def latent_ring_attention(q: Any, latent: Any, rope_k: Any, w_uk: Any, w_uv: Any, comm, *,
                          layout: str, causal: bool, softmax_scale: Optional[float] = None,
                          return_lse: bool = False, cu_seqlens: Any = None, window: Any = None,
                          mask: Any = None, method: str = "auto",
                          kernel: Optional[Kernel] = None, sinks: Any = None,
                          softcap: Optional[float] = None):
    """Attention of this rank's queries q [b, s/P, h, d_nope + d_rope] over
    the whole sequence's keys and values, expanded from ``latent`` [b, s/P, r]
    and ``rope_k`` [b, s/P, d_rope] (this rank's shards, as
    ``shard_sequence(..., layout=layout)`` makes them) by ``w_uk`` [r, h,
    d_nope] and ``w_uv`` [r, h, d_v] (``expand``). Returns out [b, s/P, h,
    d_v] (and, with ``return_lse``, lse [b, h, s/P]). The options are
    ``ring_attention``'s, but ``method``: "auto" (the latent between hosts,
    "expanded" on one), "ring", "allgather" or "expanded" (the module's
    docstring); ``softmax_scale`` defaults to 1/sqrt(d_nope + d_rope)
    (DeepSeek's YaRN scaling multiplies it: pass it)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return latent_ring_attention_with(options, q, latent, rope_k, w_uk, w_uv, comm,
                                      layout=layout, sinks=sinks, return_lse=return_lse)


def latent_ring_attention_with(options: AttentionOptions, q: Any, latent: Any, rope_k: Any,
                               w_uk: Any, w_uv: Any, comm, *, layout: str, sinks: Any = None,
                               return_lse: bool = False):
    """``latent_ring_attention`` with its options as one value."""
    q, latent, rope_k, w_uk, w_uv, sinks = detached(q, latent, rope_k, w_uk, w_uv, sinks)
    call = _prepare(comm, "latent_ring_attention", options, q, latent, rope_k, w_uk, w_uv,
                    layout, sinks)
    out, lse = latent_forward(call, q, latent, rope_k, w_uk, w_uv, comm, options.method, sinks)
    return (out, lse) if return_lse else out


def latent_ring_attention_backward(dout: Any, q: Any, latent: Any, rope_k: Any, w_uk: Any,
                                   w_uv: Any, out: Any, lse: Any, comm, *, layout: str,
                                   causal: bool, softmax_scale: Optional[float] = None,
                                   cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                                   method: str = "auto", kernel: Optional[Kernel] = None,
                                   sinks: Any = None, softcap: Optional[float] = None):
    """(dq, dlatent, drope_k, dw_uk, dw_uv) of ``latent_ring_attention``
    for this rank's shards, given the forward's ``out`` and ``lse``; dq,
    dlatent and drope_k in their inputs' dtypes, the weights' gradients
    this rank's share (the ranks' shares add up to them) in the accumulator
    dtype. With ``sinks``: dsinks (this rank's share) after them."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return latent_ring_attention_backward_with(options, dout, q, latent, rope_k, w_uk, w_uv, out,
                                               lse, comm, layout=layout, sinks=sinks)


def latent_ring_attention_backward_with(options: AttentionOptions, dout: Any, q: Any,
                                        latent: Any, rope_k: Any, w_uk: Any, w_uv: Any,
                                        out: Any, lse: Any, comm, *, layout: str,
                                        sinks: Any = None):
    """``latent_ring_attention_backward`` with its options as one value."""
    dout, q, latent, rope_k, w_uk, w_uv, out, lse, sinks = detached(
        dout, q, latent, rope_k, w_uk, w_uv, out, lse, sinks)
    b, s, h = tuple(q.shape[:3]) if len(q.shape) == 4 else (0, 0, 0)
    width = (b, s, h, w_uv.shape[-1]) if len(w_uv.shape) == 3 else ()
    extra = (("dout", dout, width), ("out", out, width), ("lse", lse, (b, h, s)))
    call = _prepare(comm, "latent_ring_attention_backward", options, q, latent, rope_k, w_uk,
                    w_uv, layout, sinks, extra)
    grads = latent_backward(call, dout, q, latent, rope_k, w_uk, w_uv, out, lse, comm,
                            options.method)
    return with_sink_gradient(grads, dout, out, lse, sinks)


def _prepare(comm, op: str, options: AttentionOptions, q: Any, latent: Any, rope_k: Any,
             w_uk: Any, w_uv: Any, layout: str, sinks: Any, extra: tuple = ()) -> AttentionCall:
    """The ring's checks and agreement (``prepare``) with the latent's shapes
    in place of K's and V's, and the weights' shapes agreed."""
    return prepare(comm, op, q, latent, rope_k, options, layout=layout, sinks=sinks,
                   check_inputs=lambda: check_latent(q, latent, rope_k, w_uk, w_uv, extra),
                   check=lambda: _check_method(options.method),
                   weights=(tuple(getattr(w_uk, "shape", ())), tuple(getattr(w_uv, "shape", ()))))


def _check_method(method: str) -> None:
    if method not in LATENT_METHODS:
        raise ValueError(f"latent attention takes method {', '.join(map(repr, LATENT_METHODS))}, "
                         f"got {method!r} (the sparse exchange picks rows of expanded K and V: "
                         f"use ring_attention on expanded heads for it)")


def check_latent(q: Any, latent: Any, rope_k: Any, w_uk: Any, w_uv: Any,
                 extra: tuple = ()) -> None:
    """q [b, s, h, d_nope + d_rope], latent [b, s, r], rope_k [b, s, d_rope],
    w_uk [r, h, d_nope], w_uv [r, h, d_v], of one framework and dtype, and
    the ``extra`` (name, array, shape) triples; else a ValueError naming
    what is off."""
    named = (("q", q), ("latent", latent), ("rope_k", rope_k), ("w_uk", w_uk), ("w_uv", w_uv))
    check_together(named, ("[batch, seq, heads, qk_head_dim]", "[batch, seq, kv_lora_rank]",
                           "[batch, seq, rope_dim]", "[kv_lora_rank, heads, nope_dim]",
                           "[kv_lora_rank, heads, v_head_dim]"))
    (b, s, h, d), (r, uk_heads, nope) = q.shape, w_uk.shape
    if tuple(latent.shape[:2]) != (b, s) or tuple(rope_k.shape[:2]) != (b, s):
        raise ValueError(f"q {tuple(q.shape)}, latent {tuple(latent.shape)} and rope_k "
                         f"{tuple(rope_k.shape)} must agree on batch and local sequence length")
    if latent.shape[2] != r or w_uv.shape[0] != r:
        raise ValueError(f"latent {tuple(latent.shape)}, w_uk {tuple(w_uk.shape)} and w_uv "
                         f"{tuple(w_uv.shape)} must agree on the latent size (kv_lora_rank)")
    if (uk_heads, w_uv.shape[1]) != (h, h):
        raise ValueError(f"w_uk {tuple(w_uk.shape)} and w_uv {tuple(w_uv.shape)} must have q's "
                         f"{h} heads")
    if nope + rope_k.shape[2] != d:
        raise ValueError(f"q's head size {d} must be w_uk's {nope} (nope) plus rope_k's "
                         f"{rope_k.shape[2]} (rope)")
    check_dtype(named, extra)


def _joined(latent: Any, rope_k: Any) -> Any:
    """What travels: [latent, rope_k] [b, s, r + d_rope]."""
    return namespace(latent).concat([latent, rope_k], axis=-1)


def _split(block: Any, r: int) -> Tuple[Any, Any]:
    return block[..., :r], block[..., r:]


def resolved(comm, method: str) -> str:
    """``method`` with "auto" decided, the same on every rank: the heads
    expanded where every rank shares one host, the latent between hosts."""
    if method != "auto":
        return method
    return "expanded" if comm.topology.num_nodes == 1 else "ring"


def latent_forward(call: AttentionCall, q: Any, latent: Any, rope_k: Any, w_uk: Any, w_uv: Any,
                   comm, method: str, sinks: Any = None):
    """(out, lse) of checked and agreed inputs: the latent around the ring
    (or gathered once), each block expanded where it arrives; or, method
    "expanded", each rank's own shard expanded and the plain ring."""
    placement, r = call.placement, latent.shape[-1]
    mine = placement.spans(comm.rank)
    method = resolved(comm, method)
    if method == "expanded":
        return ring_forward(call, q, *expand(latent, rope_k, w_uk, w_uv), comm, "ring", sinks)
    if method == "allgather":
        order, spans = placement.in_order()
        whole = in_order(comm.allgather(_joined(latent, rope_k), axis=1), order, axis=1)
        k, v = expand(*_split(whole, r), w_uk, w_uv)
        state = attend(call.kernel, q, k, v, call.blocks(mine, spans), call.scale)
    else:
        state = None
        for source, block in RingExchange(comm).rotate(_joined(latent, rope_k)):
            k, v = expand(*_split(block, r), w_uk, w_uv)
            state = attend(call.kernel, q, k, v, call.blocks(mine, placement.spans(source)),
                           call.scale, state)
    return finish(state, q, sinks, w_uv.shape[-1])


def latent_backward(call: AttentionCall, dout: Any, q: Any, latent: Any, rope_k: Any, w_uk: Any,
                    w_uv: Any, out: Any, lse: Any, comm, method: str):
    """(dq, dlatent, drope_k, dw_uk, dw_uv) of checked and agreed inputs
    (``latent_forward``'s mirror)."""
    xp, placement, kernel, scale = call.xp, call.placement, call.kernel, call.scale
    r, key_dim = latent.shape[-1], q.shape[-1]
    mine = placement.spans(comm.rank)
    method = resolved(comm, method)
    if method == "expanded":
        dq, dk, dv = ring_backward(call, dout, q, *expand(latent, rope_k, w_uk, w_uv), out, lse,
                                   comm, "ring", accumulated=True)
        own, d_uk, d_uv = contract(dk, dv, latent, w_uk, w_uv)
    elif method == "allgather":
        order, spans = placement.in_order()
        whole = in_order(comm.allgather(_joined(latent, rope_k), axis=1), order, axis=1)
        held, rope = _split(whole, r)
        k, v = expand(held, rope, w_uk, w_uv)
        dq, dkv = attend_backward(kernel, dout, q, k, v, out, lse, call.blocks(mine, spans), scale)
        d_block, d_uk, d_uv = contract(*split(dkv, key_dim), held, w_uk, w_uv)
        own = reduce_scattered(in_order(d_block, np.argsort(order), axis=1), comm, axis=1)
    else:
        wide = accumulator_dtype(q)
        d_uk = xp.zeros(w_uk.shape, dtype=wide, device=device(q))
        d_uv = xp.zeros(w_uv.shape, dtype=wide, device=device(q))
        dq = carried = None  # carried: d[latent, rope_k] of the block one hop ahead
        for source, block in RingExchange(comm).rotate(_joined(latent, rope_k)):
            held, rope = _split(block, r)
            k, v = expand(held, rope, w_uk, w_uv)
            dq, dkv = attend_backward(kernel, dout, q, k, v, out, lse,
                                      call.blocks(mine, placement.spans(source)), scale, dq)
            d_block, d_uk_part, d_uv_part = contract(*split(dkv, key_dim), held, w_uk, w_uv)
            d_uk, d_uv = d_uk + d_uk_part, d_uv + d_uv_part
            if carried is not None:
                d_block += carried.wait()
            carried = comm.ring_shift_async(d_block, lane=1)  # overlaps the next latent hop
        own = carried.wait()
    d_latent, d_rope = _split(own, r)
    return (xp.astype(dq, q.dtype), xp.astype(d_latent, latent.dtype),
            xp.astype(d_rope, rope_k.dtype), d_uk, d_uv)
