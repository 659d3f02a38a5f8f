"""Ring Attention, forward and backward.

Each rank holds a shard of the sequence (q, k, v [batch, seq/P, heads, dim]).
K and V travel around the ring; at every step each rank attends its queries
to the block it holds and merges the result into its running output with the
online softmax (``merge``). Under a causal mask, which (query, key) chunk
pairs are visible depends on the layout (``_visible``); zigzag makes every
step cost the same on every rank.

Backward: dQ accumulates locally; dK and dV for a block accumulate in float32
and travel one hop behind their K/V block, each rank adding its part, so
that after P steps each block's gradients arrive at its owner.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ..arrays import Native, unwrap
from ..attention_inputs import backward_extras, check_qkv, problem_of, scale_of, settings
from . import kernel as _kernel
from .exchange import RingExchange
from .layout import check_layout
from .merge import merge_into

AttnFn = Callable[[Any, Any, Any, bool, float], Tuple[Any, Any]]


def _visible(rank: int, source: int, causal: bool, layout: str, length: int):
    """Which part of this rank's queries attends to which part of the block
    from ``source``: (query slice, key slice, diagonal-causal), or None when
    the causal mask hides the whole block."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True  # zigzag: chunks r < 2P-1-r, still in order
    if layout == "contiguous":
        return (everything, everything, False) if source < rank else None
    half = length // 2
    if source < rank:  # both our chunks follow its first chunk and precede its second
        return everything, slice(None, half), False
    return slice(half, None), everything, False  # only our late chunk sees it, all of it


def _check(q: Native, k: Native, v: Native, layout: str, extra=()) -> None:
    check_layout(layout)
    check_qkv(q, k, v, extra)
    if layout == "zigzag" and q.data.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank, so the local "
                         f"sequence length must be even, got {q.data.shape[1]}")


def _agree(comm, op: str, q: Native, k: Native, problem, causal, layout, scale) -> None:
    """Every rank checks its inputs; all ranks must agree on shapes (local
    sequence lengths included), dtype and settings, or all raise."""
    comm.agree(op, tuple(q.data.shape), tuple(k.data.shape), q.dtype.name,
               *settings(("causal", causal), ("layout", layout), ("scale", scale)),
               problem=problem)


def ring_attention(q: Any, k: Any, v: Any, comm, causal: bool = False,
                   layout: str = "contiguous", softmax_scale: Optional[float] = None,
                   return_lse: bool = False, attn_fn: Optional[AttnFn] = None):
    """Attention of this rank's queries over the whole (sharded) sequence.

    q [b, s/P, h, d]; k, v [b, s/P, hk, d] with h % hk == 0; shards as
    ``shard_sequence(..., layout)`` makes them. Returns out (q's dtype and
    framework) and, with ``return_lse``, lse [b, h, s/P] float32.
    ``attn_fn(q, k, v, causal, softmax_scale) -> (out, lse)`` replaces the
    local block kernel (e.g. a flash-attention kernel)."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    scale = scale_of(nq, softmax_scale)
    _agree(comm, "ring_attention", nq, nk, problem_of(_check, nq, nk, nv, layout), causal,
           layout, scale)
    xp = nq.xp
    block_fn = attn_fn or _kernel.attention_forward
    length = nq.data.shape[1]
    out = lse = None
    packed = xp.stack([nk.data, nv.data])  # K and V: one message a step
    for source, block in RingExchange(comm).rotate(packed):
        visible = _visible(comm.rank, source, causal, layout, length)
        if visible is None:
            continue
        rows, cols, diagonal = visible
        block_out, block_lse = block_fn(nq.data[:, rows], block[0][:, cols], block[1][:, cols],
                                        diagonal, scale)
        if out is None:  # the first step is this rank's own block: every row
            out = block_out.astype(xp.float32, copy=False)
            lse = block_lse.astype(xp.float32, copy=False)
        else:
            merge_into(out[:, rows], lse[:, :, rows], block_out, block_lse)
    result = nq.wrap(out.astype(nq.data.dtype))
    return (result, nq.wrap(lse)) if return_lse else result


def ring_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                            causal: bool = False, layout: str = "contiguous",
                            softmax_scale: Optional[float] = None):
    """(dq, dk, dv) of ``ring_attention`` for this rank's shards, given the
    forward's ``out`` and ``lse`` and the output gradient ``dout``."""
    nq, nk, nv = unwrap(q), unwrap(k), unwrap(v)
    nd, no, nl = unwrap(dout), unwrap(out), unwrap(lse)
    scale = scale_of(nq, softmax_scale)
    problem = problem_of(_check, nq, nk, nv, layout, backward_extras(nq, nd, no, nl))
    _agree(comm, "ring_attention_backward", nq, nk, problem, causal, layout, scale)
    length = nq.data.shape[1]
    xp = nq.xp
    delta = _kernel.row_dot(nd.data, no.data)
    dq = xp.zeros(nq.data.shape, dtype=xp.float32)
    carried = None  # dK and dV of the block one hop ahead, on their way around
    packed = xp.stack([nk.data, nv.data])
    for source, block in RingExchange(comm).rotate(packed):
        grads = xp.zeros((2,) + tuple(nk.data.shape), dtype=xp.float32)
        visible = _visible(comm.rank, source, causal, layout, length)
        if visible is not None:
            rows, cols, diagonal = visible
            dq_part, dk_part, dv_part = _kernel.attention_backward(
                nd.data[:, rows], nq.data[:, rows], block[0][:, cols], block[1][:, cols],
                no.data[:, rows], nl.data[:, :, rows], diagonal, scale,
                delta=delta[:, :, rows])
            dq[:, rows] += dq_part
            grads[0][:, cols] += dk_part
            grads[1][:, cols] += dv_part
        if carried is not None:
            grads += carried.wait()
        carried = comm.ring_shift_async(grads)
    own = carried.wait()  # this rank's own block, every rank's part added
    return (nq.wrap(dq.astype(nq.data.dtype)), nk.wrap(own[0].astype(nk.data.dtype)),
            nv.wrap(own[1].astype(nv.data.dtype)))
