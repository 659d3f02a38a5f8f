"""``commlib.recurrent``'s collectives for JAX, usable inside ``jax.jit`` and
differentiable (``jax.custom_vjp``): the state entering each piece of a
shard, the tokens before each piece, and a sum over ranks. Forward and
backward are the core's own functions traced on a ``TracedComm`` (their
all-gathers and all-to-alls become buffer callbacks in the program), the
backwards the core's mirror communication, not autodiff of the core."""

from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp

from commlib import recurrent
from commlib.sequence.documents import as_offsets

from ._traced_comm import traced

__all__ = ["incoming_state", "halo", "summed_over_ranks"]


def _where(comm, op: str, layout: str, cu_seqlens: Any, mask: Any) -> tuple:
    """Hashable settings (``custom_vjp``'s nondiff arguments): the
    communicator by identity, ``cu_seqlens`` as a tuple (concrete under
    jit; refused on every rank, in ``op``'s agreement, where it is not)."""
    if cu_seqlens is not None:
        try:
            cu_seqlens = as_offsets(cu_seqlens)
        except ValueError as error:
            traced(comm).agree(op, problem=error)
    return (comm, layout, cu_seqlens, mask)


def _opened(where: tuple) -> Tuple[Any, dict]:
    comm, layout, cu_seqlens, mask = where
    return traced(comm), dict(layout=layout, cu_seqlens=cu_seqlens, mask=mask)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _incoming_state(transition, offset, where):
    return _incoming_state_forward(transition, offset, where)


def _incoming_state_forward(transition, offset, where):
    comm, options = _opened(where)
    with comm.ordered():
        return recurrent.incoming_state(transition, offset, comm, **options)


def _incoming_state_fwd(transition, offset, where):
    return _incoming_state_forward(transition, offset, where), (transition, offset)


def _incoming_state_bwd(where, saved, grad_state):
    comm, options = _opened(where)
    with comm.ordered():
        return tuple(recurrent.incoming_state_backward(grad_state, *saved, comm, **options))


_incoming_state.defvjp(_incoming_state_fwd, _incoming_state_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _halo(x, call):
    return _halo_forward(x, call)


def _halo_forward(x, call):
    width, axis, _, where = call
    comm, options = _opened(where)
    with comm.ordered():
        return recurrent.halo(x, width, comm, axis=axis, **options)


def _halo_fwd(x, call):
    return _halo_forward(x, call), None


def _halo_bwd(call, _, grad_halo):
    width, axis, shape, where = call
    comm, options = _opened(where)
    with comm.ordered():
        return (recurrent.halo_backward(grad_halo, shape, width, comm, axis=axis, **options),)


_halo.defvjp(_halo_fwd, _halo_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def summed_over_ranks(x, comm):
    """``x`` summed over every rank, on every rank; its gradient likewise.
    Collective: every rank must use the result alike (or none), so that
    every rank runs the backward."""
    return _summed(x, comm)


def _summed(x, comm):
    comm = traced(comm)
    with comm.ordered():
        return jnp.sum(comm.allgather(x[None], axis=0), axis=0)


summed_over_ranks.defvjp(lambda x, comm: (_summed(x, comm), None),
                         lambda comm, _, grad: (_summed(grad, comm),))


def incoming_state(transition, offset, comm, *, layout: str, cu_seqlens: Any = None,
                   mask: Any = None):
    """``commlib.recurrent.incoming_state`` for JAX arrays, jit-able and
    differentiable in ``transition`` and ``offset`` (``cu_seqlens`` and
    ``mask`` concrete). Every rank must run the backward (it is collective)."""
    return _incoming_state(transition, offset, _where(comm, "recurrent.incoming_state", layout,
                                                        cu_seqlens, mask))


def halo(x, width: int, comm, *, layout: str, axis: int = 1, cu_seqlens: Any = None,
         mask: Optional[Any] = None):
    """``commlib.recurrent.halo`` for JAX arrays, jit-able and differentiable
    in ``x``. Every rank must run the backward (it is collective)."""
    return _halo(x, (width, axis, tuple(x.shape), _where(comm, "recurrent.halo", layout, cu_seqlens,
                                                         mask)))
