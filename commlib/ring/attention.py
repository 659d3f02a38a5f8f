"""Ring Attention, forward and backward, in the caller's framework.

Each rank holds a shard of the sequence (q, k, v [batch, seq/P, heads, dim]).
K and V travel around the ring; at every step each rank attends its queries
to the block it holds with the block kernel (PyTorch's fused SDPA ops for
torch tensors, the tiled array-API kernel otherwise, or the caller's
``kernel``) and merges the result into its running output with the online
softmax (``merge``), in float32. Under a causal mask, which (query, key)
chunk pairs are visible depends on the layout (``_visible``); zigzag makes
every step cost the same on every rank. Only bytes cross into the
Communicator: K and V in their own dtype (bfloat16 moves half the bytes of
float32).

Backward: dQ accumulates locally; dK and dV for a block accumulate in float32
and travel one hop behind their K/V block, each rank adding its part, so
that after P steps each block's gradients arrive at its owner.
"""

from __future__ import annotations

from typing import Any, Optional

import array_api_extra as xpx

from ..attention_inputs import agree_on_inputs, backward_extras, check_qkv, problem_of, scale_of
from ..kernels import Kernel, kernel_for
from ..namespace import detached, device, namespace
from .exchange import RingExchange
from .layout import check_layout
from .merge import merge

EVERYTHING = slice(None)


def _visible(rank: int, source: int, causal: bool, layout: str, length: int):
    """Which part of this rank's queries attends to which part of the block
    from ``source``: (query slice, key slice, diagonal-causal), or None when
    the causal mask hides the whole block."""
    if not causal:
        return EVERYTHING, EVERYTHING, False
    if source == rank:
        return EVERYTHING, EVERYTHING, True  # zigzag: chunks r < 2P-1-r, still in order
    if layout == "contiguous":
        return (EVERYTHING, EVERYTHING, False) if source < rank else None
    half = length // 2
    if source < rank:  # both our chunks follow its first chunk and precede its second
        return EVERYTHING, slice(None, half), False
    return slice(half, None), EVERYTHING, False  # only our late chunk sees it, all of it


def _check(q, k, v, layout: str, extra=()) -> None:
    check_layout(layout)
    check_qkv(q, k, v, extra)
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"the zigzag layout holds two equal chunks per rank, so the local "
                         f"sequence length must be even, got {q.shape[1]}")


def ring_attention(q: Any, k: Any, v: Any, comm, causal: bool = False,
                   layout: str = "contiguous", softmax_scale: Optional[float] = None,
                   return_lse: bool = False, kernel: Optional[Kernel] = None):
    """Attention of this rank's queries over the whole (sharded) sequence.

    q [b, s/P, h, d]; k, v [b, s/P, hk, d] with h % hk == 0; shards as
    ``shard_sequence(..., layout)`` makes them. Returns out (q's framework,
    device and dtype) and, with ``return_lse``, lse [b, h, s/P] float32.
    ``kernel`` replaces the built-in block kernel (``commlib.kernels``)."""
    q, k, v = detached(q, k, v)
    scale = scale_of(q, softmax_scale)
    agree_on_inputs(comm, "ring_attention", q, k, problem_of(_check, q, k, v, layout),
                    causal=causal, layout=layout, scale=scale)
    xp = namespace(q)
    kernel = kernel or kernel_for(q)
    out = lse = None
    for source, block in RingExchange(comm).rotate(xp.stack([k, v])):  # one message a step
        visible = _visible(comm.rank, source, causal, layout, q.shape[1])
        if visible is None:
            continue
        rows, cols, diagonal = visible
        block_out, block_lse = kernel.forward(q[:, rows], block[0][:, cols], block[1][:, cols],
                                              diagonal, scale)
        if out is None:  # the first step is this rank's own block: every row
            out = xp.astype(block_out, xp.float32, copy=False)
            lse = xp.astype(block_lse, xp.float32, copy=False)
            continue
        if rows == EVERYTHING:
            out, lse = merge(out, lse, block_out, block_lse)
            continue
        merged_out, merged_lse = merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
        out = xpx.at(out)[:, rows].set(merged_out)
        lse = xpx.at(lse)[:, :, rows].set(merged_lse)
    result = xp.astype(out, q.dtype)
    return (result, lse) if return_lse else result


def ring_attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, comm,
                            causal: bool = False, layout: str = "contiguous",
                            softmax_scale: Optional[float] = None,
                            kernel: Optional[Kernel] = None):
    """(dq, dk, dv) of ``ring_attention`` for this rank's shards, given the
    forward's ``out`` and ``lse`` and the output gradient ``dout``; in q's
    framework, device and dtype."""
    dout, q, k, v, out, lse = detached(dout, q, k, v, out, lse)
    scale = scale_of(q, softmax_scale)
    problem = problem_of(_check, q, k, v, layout, backward_extras(q, dout, out, lse))
    agree_on_inputs(comm, "ring_attention_backward", q, k, problem, causal=causal,
                    layout=layout, scale=scale)
    xp = namespace(q)
    kernel = kernel or kernel_for(q)
    dq = xp.zeros(q.shape, dtype=xp.float32, device=device(q))
    carried = None  # dK and dV of the block one hop ahead, on their way around
    for source, block in RingExchange(comm).rotate(xp.stack([k, v])):
        grads = xp.zeros((2,) + tuple(k.shape), dtype=xp.float32, device=device(q))
        visible = _visible(comm.rank, source, causal, layout, q.shape[1])
        if visible is not None:
            rows, cols, diagonal = visible
            dq_part, dk_part, dv_part = kernel.backward(
                dout[:, rows], q[:, rows], block[0][:, cols], block[1][:, cols],
                out[:, rows], lse[:, :, rows], diagonal, scale)
            dq = xpx.at(dq)[:, rows].add(xp.astype(dq_part, xp.float32, copy=False))
            grads = xpx.at(grads)[:, :, cols].set(
                xp.astype(xp.stack([dk_part, dv_part]), xp.float32, copy=False))
        if carried is not None:
            grads += carried.wait()
        carried = comm.ring_shift_async(grads, lane=1)  # overlaps the next K/V hop
    own = carried.wait()  # this rank's own block, every rank's part added
    return xp.astype(dq, q.dtype), xp.astype(own[0], k.dtype), xp.astype(own[1], v.dtype)
