"""JAX operations over commlib, usable inside ``jax.jit`` and
differentiable with ``jax.grad`` (``jax.custom_vjp``), as one XLA program.

The algorithms are commlib's own (ring, Ulysses, the hybrid), traced by JAX
on a ``TracedComm`` (``bindings/jax/_traced_comm.py``): the schedule, the
merge, the relayouts and the block kernel are jnp in the jitted program, on
the arrays' device; only the transfers leave it, as buffer callbacks that
hand XLA's buffers to the real Communicator (no copy on the CPU; on a GPU on
XLA's stream). Forward and backward are both traced; the forward keeps
``out`` and ``lse`` for the backward. Shapes and arguments are checked on
every rank when JAX traces. MoE dispatch and combine (``Dispatcher``, in
``bindings/jax/_moe.py``) are traced the same way, drop-and-pad with a fixed
capacity, and so are the sharded Gated DeltaNet and Mamba2 mixers
(``gated_delta_rule``, ``mamba2_scan``, in ``bindings/jax/_recurrent.py``).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import numpy as np

from commlib.hybrid.attention import hybrid_attention_backward_with, hybrid_attention_with
from commlib.kernels import Kernel
from commlib.ring.attention import ring_attention_backward_with, ring_attention_with
from commlib.sequence.options import AttentionOptions
from commlib.ulysses.attention import ulysses_attention_backward_with, ulysses_attention_with

from ._moe import Dispatcher
from ._recurrent import gated_delta_rule, mamba2_scan
from ._traced_comm import traced

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "Dispatcher",
           "gated_delta_rule", "mamba2_scan"]


def _differentiable(forward, backward):
    """A custom_vjp attention from a core forward (``*_attention_with``,
    returning out, lse) and backward, both traced on the TracedComm of the
    call's communicator; the ``call`` (communicator, layout, the
    algorithm's own arguments, the ``AttentionOptions``: static, hashable)
    is not differentiated; ``sinks`` (None, or one logit per query head)
    are, when given."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attend(q, k, v, sinks, call):
        return _forward(q, k, v, sinks, call)[0]

    def _forward(q, k, v, sinks, call):
        comm, layout, extra, options = call
        comm = traced(comm)
        with comm.ordered():
            return forward(options, q, k, v, comm, *extra, layout=layout, sinks=sinks,
                           return_lse=True)

    def attend_fwd(q, k, v, sinks, call):
        out, lse = _forward(q, k, v, sinks, call)
        return out, (q, k, v, out, lse, sinks)

    def attend_bwd(call, saved, dout):
        *arrays, sinks = saved
        comm, layout, extra, options = call
        comm = traced(comm)
        with comm.ordered():
            grads = tuple(backward(options, dout, *arrays, comm, *extra, layout=layout,
                                   sinks=sinks))
        return grads if sinks is not None else (*grads, None)

    attend.defvjp(attend_fwd, attend_bwd)

    def run(q, k, v, sinks, call):
        if sinks is not None and not isinstance(sinks, jax.Array):
            return _forward(q, k, v, sinks, call)[0]  # the core refuses them on every rank
        return attend(q, k, v, sinks, call)
    return run


_ring_attention = _differentiable(ring_attention_with, ring_attention_backward_with)
_ulysses_attention = _differentiable(ulysses_attention_with, ulysses_attention_backward_with)
_hybrid_attention = _differentiable(hybrid_attention_with, hybrid_attention_backward_with)


def _options(cu_seqlens: Any, window: Any, **values: Any) -> AttentionOptions:
    """The call's options, hashable for a static argument (offsets and
    windows as tuples)."""
    return AttentionOptions(
        cu_seqlens=None if cu_seqlens is None else static_tuple("cu_seqlens", cu_seqlens),
        window=None if window is None else static_tuple("window", window), **values)


def static_tuple(name: str, value: Any) -> tuple:
    """``value`` as a tuple of Python numbers (None kept), for a static
    argument; a traced value cannot be one."""
    try:
        return tuple(None if x is None else np.asarray(x).item() for x in value)
    except (TypeError, jax.errors.ConcretizationTypeError) as error:
        raise ValueError(f"{name} must be concrete under jax.jit (a list, tuple or NumPy "
                         f"array decided at trace time), got {type(value).__name__}") from error


def ring_attention(q, k, v, comm, *, layout: str, causal: bool,
                   softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                   window: Any = None, mask: Any = None, method: str = "auto",
                   kernel: Optional[Kernel] = None, sinks: Any = None,
                   softcap: Optional[float] = None):
    """Differentiable, jit-able ``commlib.ring.ring_attention`` for JAX arrays.
    ``cu_seqlens`` must be concrete (a list or NumPy array: static under
    jit), and ``mask`` is (a ``commlib.sequence.masks.Mask``): which blocks are
    computed is decided at trace time. ``sinks`` [h] (one logit per query
    head) are differentiated: this rank's queries' share of their gradient
    (summed over the ranks, it is the whole). ``softcap``: a Python number
    (static), as the core's."""
    options = _options(cu_seqlens, window, causal=causal, mask=mask,
                       softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                       method=method)
    return _ring_attention(q, k, v, sinks, (comm, layout, (), options))


def ulysses_attention(q, k, v, comm, *, layout: str, causal: bool,
                      softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                      window: Any = None, mask: Any = None, kernel: Optional[Kernel] = None,
                      sinks: Any = None, softcap: Optional[float] = None):
    """Differentiable, jit-able ``commlib.ulysses.ulysses_attention`` for JAX
    arrays (``sinks`` and ``softcap`` as ``ring_attention``'s)."""
    options = _options(cu_seqlens, window, causal=causal, mask=mask,
                       softmax_scale=softmax_scale, softcap=softcap, kernel=kernel)
    return _ulysses_attention(q, k, v, sinks, (comm, layout, (), options))


def hybrid_attention(q, k, v, comm, ulysses_size: int, *, layout: str, causal: bool,
                     softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                     window: Any = None, mask: Any = None, method: str = "auto",
                     kernel: Optional[Kernel] = None, sinks: Any = None,
                     softcap: Optional[float] = None):
    """Differentiable, jit-able ``commlib.hybrid.hybrid_attention`` for JAX
    arrays (``commlib.hybrid.plan`` picks ``ulysses_size``; ``sinks`` and
    ``softcap`` as ``ring_attention``'s)."""
    options = _options(cu_seqlens, window, causal=causal, mask=mask,
                       softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                       method=method)
    return _hybrid_attention(q, k, v, sinks, (comm, layout, (ulysses_size,), options))
