"""The state that enters each piece: the shards' affine maps composed in
global order.

Each rank ran its pieces from a zero state and knows, per piece k, the map
``out = transition_k ∘ in + offset_k``. The state entering piece k+1 (in
global order) is ``s_{k+1} = transition_k ∘ s_k + offset_k``, with ``s_k = 0``
where piece k starts the sequence or a document (the recurrence resets
there). ``∘`` is a matrix product per leading index (gated delta rule:
transition [..., dk, dk], state [..., dk, dv]) or a scalar factor per
leading index (Mamba2: transition [...], state [..., headdim, dstate]).

One all-gather of every real piece's (transition, offset): each rank
receives (P-1) x pieces-per-rank pairs, O(pieces x state) bytes,
independent of the sequence length, in one latency; then every rank runs
the same cheap sequential scan (one product per piece) and keeps its own
pieces' states. A log-depth (up- and down-sweep) scan over the 2P zigzag
chunks would receive about 2 log2(2P) pairs a rank against 2 (P-1): fewer
bytes from P = 5 on, for 2 log2(2P) latencies instead of one (measured
only at P <= 3 so far).

Backward: the gradients of the incoming states ride a second all-gather
with (transition, offset); every rank recomputes the scan and runs its
adjoint over all pieces, keeping its own pieces' rows. Per rank that
receives (P-1)/P x (every rank's) pieces x (|transition| + 2 |state|), where a ring
all-reduce of every piece's two gradients moves 2 (P-1)/P x pieces x
(|transition| + |state|) and still needs every piece's transition and
state; nothing is saved from the forward.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..namespace import device, dtype_name, namespace
from .pieces import Piece, Sharding, agreed_sharding

__all__ = ["incoming_state", "incoming_state_backward"]

MATRIX, SCALAR = "matrix", "scalar"


def _kind(transition: Any, offset: Any, held: Tuple[Piece, ...]) -> str:
    """MATRIX or SCALAR by ``transition``'s ndim (see ``incoming_state``);
    the shapes checked against each other and against the pieces held."""
    namespace(transition, offset)  # one framework, or TypeError
    if offset.ndim < 3:
        raise ValueError(f"offset must be [pieces, *state] with a state of at least 2 "
                         f"dimensions ([..., dk, dv]), got shape {tuple(offset.shape)}")
    if transition.ndim == offset.ndim:
        kind, want = MATRIX, tuple(offset.shape[:-1]) + (offset.shape[-2],)
    elif transition.ndim == offset.ndim - 2:
        kind, want = SCALAR, tuple(offset.shape[:-2])
    else:
        raise ValueError(f"transition must be a matrix per leading index (ndim "
                         f"{offset.ndim}, shape [pieces, ..., dk, dk]) or a scalar per "
                         f"leading index (ndim {offset.ndim - 2}, shape [pieces, ...]) for an "
                         f"offset of shape {tuple(offset.shape)}; got ndim {transition.ndim}")
    if tuple(transition.shape) != want:
        raise ValueError(f"a {kind} transition for an offset of shape "
                         f"{tuple(offset.shape)} has shape {want}, got "
                         f"{tuple(transition.shape)}")
    if offset.shape[0] != len(held):
        raise ValueError(f"transition and offset are stacked over this rank's pieces along "
                         f"axis 0: {len(held)} here (commlib.recurrent.pieces), got "
                         f"{offset.shape[0]}")
    if dtype_name(transition) != dtype_name(offset):
        raise ValueError(f"transition and offset must have one dtype, got "
                         f"{dtype_name(transition)} and {dtype_name(offset)}")
    return kind


def _apply(kind: str, xp: Any, transition: Any, state: Any) -> Any:
    """``transition ∘ state``."""
    if kind == MATRIX:
        return xp.matmul(transition, state)
    return transition[..., None, None] * state


def _apply_transposed(kind: str, xp: Any, transition: Any, adjoint: Any) -> Any:
    """The adjoint of ``state -> transition ∘ state``, applied to ``adjoint``."""
    if kind == MATRIX:
        return xp.matmul(xp.matrix_transpose(transition), adjoint)
    return transition[..., None, None] * adjoint


def _transition_grad(kind: str, xp: Any, adjoint: Any, state: Any) -> Any:
    """d(loss)/d(transition) of ``transition ∘ state``, given ``adjoint`` of the result."""
    if kind == MATRIX:
        return xp.matmul(adjoint, xp.matrix_transpose(state))
    return xp.sum(adjoint * state, axis=(-2, -1))


def _gathered(comm, sharding: Sharding, arrays: Sequence[Any]) -> List[List[Any]]:
    """Every real piece's rows of ``arrays`` (each stacked over this rank's
    pieces), in global order: one all-gather of one flat row per piece,
    each rank's rows padded to the most real pieces any rank holds."""
    xp = namespace(arrays[0])
    held = sharding.per_rank[comm.rank]
    shapes = [tuple(a.shape[1:]) for a in arrays]
    sizes = [math.prod(shape) for shape in shapes]
    mine = [xp.concat([xp.reshape(a[i], (-1,)) for a in arrays])
            for i, piece in enumerate(held) if not piece.is_padding]
    blank = xp.zeros((sum(sizes),), dtype=arrays[0].dtype, device=device(arrays[0]))
    rows = xp.stack(mine + [blank] * (sharding.most_real - len(mine)))
    gathered = comm.allgather(rows, axis=0)
    found = []
    for rank, i in sharding.order:
        row = gathered[rank * sharding.most_real + i]
        parts, at = [], 0
        for shape, size in zip(shapes, sizes):
            parts.append(xp.reshape(row[at:at + size], shape))
            at += size
        found.append(parts)
    return found


def _scan(kind: str, xp: Any, sharding: Sharding, pairs: List[List[Any]]) -> List[Any]:
    """The state entering every real piece, in global order (None: zero)."""
    states: List[Optional[Any]] = []
    for k, (rank, i) in enumerate(sharding.order):
        if sharding.piece(rank, i).starts_document:
            states.append(None)
            continue
        transition, offset = pairs[k - 1][:2]
        before = states[-1]
        states.append(offset if before is None else
                      _apply(kind, xp, transition, before) + offset)
    return states


def _mine(comm, sharding: Sharding, rows: Dict[int, Any], like: Any) -> Any:
    """This rank's pieces' rows, stacked (zeros where ``rows`` has none)."""
    xp = namespace(like)
    zero = xp.zeros(tuple(like.shape[1:]), dtype=like.dtype, device=device(like))
    out, real = [], 0
    for piece in sharding.per_rank[comm.rank]:
        found = None if piece.is_padding else rows.get(real)
        real += not piece.is_padding
        out.append(zero if found is None else found)
    return xp.stack(out)


def _checked(comm, op: str, transition: Any, offset: Any, grad_state: Any, layout: str,
             cu_seqlens: Any, mask: Any) -> Tuple[Sharding, str]:
    kind: List[str] = []

    def check(held: Tuple[Piece, ...]) -> tuple:
        kind.append(_kind(transition, offset, held))
        if grad_state is not None and tuple(grad_state.shape) != tuple(offset.shape):
            raise ValueError(f"grad_state must have offset's shape {tuple(offset.shape)}, "
                             f"got {tuple(grad_state.shape)}")
        return kind[0], tuple(offset.shape[1:]), dtype_name(offset)
    sharding = agreed_sharding(comm, op, None, check, layout=layout, cu_seqlens=cu_seqlens,
                               mask=mask)
    return sharding, kind[0]


def incoming_state(transition: Any, offset: Any, comm, *, layout: str, cu_seqlens: Any = None,
                   mask: Any = None) -> Any:
    """The state entering each of this rank's pieces (``commlib.recurrent.pieces``),
    stacked like ``offset``: zero for a piece that starts the sequence, a
    document (with ``cu_seqlens``) or is padding. ``offset[i]``: the state
    piece i ends with from a zero state, [*state] (e.g. [B, H, dk, dv]);
    ``transition[i]``: a matrix per leading index, [*state[:-1], state[-2]]
    (``out = transition @ in + offset``, the gated delta rule), or a scalar
    per leading index, [*state[:-2]] (``out = transition[..., None, None] *
    in + offset``, Mamba2), told apart by ndim. Collective; computed in
    offset's framework and dtype."""
    sharding, kind = _checked(comm, "recurrent.incoming_state", transition, offset, None,
                              layout, cu_seqlens, mask)
    xp = namespace(offset)
    pairs = _gathered(comm, sharding, (transition, offset))
    states = _scan(kind, xp, sharding, pairs)
    own = {i: state for (rank, i), state in zip(sharding.order, states) if rank == comm.rank}
    return _mine(comm, sharding, own, offset)


def incoming_state_backward(grad_state: Any, transition: Any, offset: Any, comm, *,
                            layout: str, cu_seqlens: Any = None,
                            mask: Any = None) -> Tuple[Any, Any]:
    """(grad_transition, grad_offset) of ``incoming_state`` given
    ``grad_state`` (offset's shape), summed over every rank's uses of this
    rank's pieces. Collective."""
    sharding, kind = _checked(comm, "recurrent.incoming_state_backward", transition, offset,
                              grad_state, layout, cu_seqlens, mask)
    xp = namespace(offset)
    triples = _gathered(comm, sharding, (transition, offset, grad_state))
    states = _scan(kind, xp, sharding, triples)
    grad_transition: Dict[int, Any] = {}
    grad_offset: Dict[int, Any] = {}
    after = None  # d(loss)/d(state entering the next piece), None: zero
    for k in reversed(range(len(sharding.order))):
        rank, i = sharding.order[k]
        transition_k, _, grad_k = triples[k]
        if rank == comm.rank and after is not None:
            grad_offset[i] = after
            if states[k] is not None:
                grad_transition[i] = _transition_grad(kind, xp, after, states[k])
        if sharding.piece(rank, i).starts_document:
            after = None  # a reset: the entering state is a constant zero
        elif after is None:
            after = grad_k
        else:
            after = grad_k + _apply_transposed(kind, xp, transition_k, after)
    return (_mine(comm, sharding, grad_transition, transition),
            _mine(comm, sharding, grad_offset, offset))
