"""A block kernel run over the visible blocks of a query shard against a
key shard (``commlib.sequence.visibility.blocks``): the one place where Ring, Ulysses,
the hybrid and the all-gather mode call the kernel.

Forward: each block's (out, lse) is merged into the running (out, lse) of
its query rows with the online softmax; rows no block touched stay out 0,
lse -inf. Backward: each block adds its share to dQ of its rows and to
dK/dV of its columns. Both accumulate in the accumulator dtype
(``namespace.accumulator_dtype``: float32, float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import array_api_extra as xpx

from ..kernels import Kernel
from ..kernels.merge import merge
from ..kernels.sinks import apply_sinks
from ..namespace import accumulator_dtype, device, namespace
from .kv import joined, joined_shape
from .visibility import Block

State = Optional[Tuple[Any, Any]]


def _run(direction, block: Block, like: Any, arrays: tuple, scale: float):
    """One kernel direction on one block: its causal mode, or its mask."""
    if block.kind == "masked":
        mask = namespace(like).asarray(block.mask, device=device(like))
        return direction(*arrays, False, scale, mask=mask)
    return direction(*arrays, block.kind == "causal", scale)


def attend(kernel: Kernel, q: Any, k: Any, v: Any, blocks: Sequence[Block], scale: float,
           state: State = None) -> State:
    """``state`` (out [b, s, h, d], lse [b, h, s], in q's accumulator
    dtype) with q's view of these key blocks merged in; None while no block
    was seen."""
    xp, wide = namespace(q), accumulator_dtype(q)
    rows_all = q.shape[1]
    for block in blocks:
        rows, cols = block.row_slice, block.col_slice
        part_out, part_lse = _run(kernel.forward, block, q,
                                  (q[:, rows], k[:, cols], v[:, cols]), scale)
        part_out = xp.astype(part_out, wide, copy=False)
        part_lse = xp.astype(part_lse, wide, copy=False)
        whole = block.rows == (0, rows_all)
        if state is None and whole:
            state = (part_out, part_lse)
            continue
        if state is None:
            state = _unseen(q, wide, v.shape[-1])
        out, lse = state
        if whole:
            state = merge(out, lse, part_out, part_lse)
            continue
        merged_out, merged_lse = merge(out[:, rows], lse[:, :, rows], part_out, part_lse)
        state = (xpx.at(out)[:, rows].set(merged_out),
                 xpx.at(lse)[:, :, rows].set(merged_lse))
    return state


def finish(state: State, q: Any, sinks: Optional[Any] = None,
           value_dim: Optional[int] = None) -> Tuple[Any, Any]:
    """(out in q's dtype, lse in its accumulator dtype) of a finished ``state``
    (every key merged in), with q's heads' ``sinks`` in its softmax
    (``sinks.apply_sinks``: once, here, at the end); a shard that saw no
    key at all (all padding) gets zeros of v's head size ``value_dim``
    (default q's) and -inf (the sink, with sinks)."""
    width = q.shape[-1] if value_dim is None else value_dim
    if state is None and sinks is None:
        return _unseen(q, q.dtype, width)
    out, lse = apply_sinks(*(state or _unseen(q, accumulator_dtype(q), width)), sinks)
    return namespace(q).astype(out, q.dtype), lse


def _unseen(q: Any, dtype: Any, width: int) -> Tuple[Any, Any]:
    """(out, lse) of rows that saw no key: zeros in ``dtype`` (``width``
    wide), -inf."""
    xp = namespace(q)
    return (xp.zeros((*q.shape[:-1], width), dtype=dtype, device=device(q)),
            xp.full((q.shape[0], q.shape[2], q.shape[1]), -math.inf,
                    dtype=accumulator_dtype(q), device=device(q)))


def attend_backward(kernel: Kernel, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                    blocks: Sequence[Block], scale: float, dq: Any = None,
                    dkv: Any = None) -> Tuple[Any, Any]:
    """``dq`` (like q) and ``dkv`` (dK and dV as ``kv.joined`` lays them
    out), in q's accumulator dtype, with these blocks' shares added (None:
    zeros); ``out``/``lse`` are the global ones."""
    xp, wide = namespace(q), accumulator_dtype(q)
    dkv_shape = joined_shape(k.shape, v.shape)
    for block in blocks:
        rows, cols = block.row_slice, block.col_slice
        arrays = (dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows],
                  lse[:, :, rows])
        dq_part, dk_part, dv_part = (xp.astype(g, wide, copy=False)
                                     for g in _run(kernel.backward, block, q, arrays, scale))
        dq = _added(dq, dq_part, (slice(None), rows), block.rows == (0, q.shape[1]), q.shape, q)
        dkv = _added(dkv, joined(dk_part, dv_part), (slice(None), slice(None), cols),
                     block.cols == (0, k.shape[1]), dkv_shape, q)
    return (_added(dq, None, (), True, q.shape, q), _added(dkv, None, (), True, dkv_shape, q))


def _added(total: Any, part: Any, where: tuple, whole: bool, shape: tuple, like: Any) -> Any:
    """``total`` + ``part`` at ``where`` (all of it when ``whole``);
    a None total is zeros of ``shape``, never allocated when the first part
    covers it (a plain sequence: one block)."""
    if total is None and part is not None and whole:
        return part
    if total is None:
        xp = namespace(like)
        total = xp.zeros(shape, dtype=accumulator_dtype(like), device=device(like))
    if part is None:
        return total
    return total + part if whole else xpx.at(total)[where].add(part)
