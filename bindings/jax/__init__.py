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

from commlib import hybrid as _hybrid
from commlib import ring as _ring
from commlib import ulysses as _ulysses
from commlib.kernels import Kernel

from ._moe import Dispatcher
from ._recurrent import gated_delta_rule, mamba2_scan
from ._traced_comm import traced

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "Dispatcher",
           "gated_delta_rule", "mamba2_scan"]


def _differentiable(forward, backward):
    """A custom_vjp attention from a core forward (returning out, lse) and
    backward, both traced on the TracedComm of ``settings``' communicator;
    ``settings`` (communicator, flags) are not differentiated; ``sinks``
    (None, or one logit per query head) are, when given."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def attend(q, k, v, sinks, settings):
        return _forward(q, k, v, sinks, settings)[0]

    def _forward(q, k, v, sinks, settings):
        options = dict(settings)
        comm = traced(options.pop("comm"))
        with comm.ordered():
            return forward(q, k, v, comm=comm, return_lse=True, sinks=sinks, **options)

    def attend_fwd(q, k, v, sinks, settings):
        out, lse = _forward(q, k, v, sinks, settings)
        return out, (q, k, v, out, lse, sinks)

    def attend_bwd(settings, saved, dout):
        *arrays, sinks = saved
        options = dict(settings)
        comm = traced(options.pop("comm"))
        with comm.ordered():
            grads = tuple(backward(dout, *arrays, comm=comm, sinks=sinks, **options))
        return grads if sinks is not None else (*grads, None)

    attend.defvjp(attend_fwd, attend_bwd)

    def call(q, k, v, sinks, settings):
        if sinks is not None and not isinstance(sinks, jax.Array):
            return _forward(q, k, v, sinks, settings)[0]  # the core refuses them on every rank
        return attend(q, k, v, sinks, settings)
    return call


_ring_attention = _differentiable(_ring.ring_attention, _ring.ring_attention_backward)
_ulysses_attention = _differentiable(_ulysses.ulysses_attention,
                                     _ulysses.ulysses_attention_backward)
_hybrid_attention = _differentiable(_hybrid.hybrid_attention, _hybrid.hybrid_attention_backward)


def _settings(**values):
    """Hashable settings for nondiff_argnums (the communicator by identity;
    offsets and windows as tuples)."""
    for name in ("cu_seqlens", "window"):
        if values.get(name) is not None:
            values[name] = static_tuple(name, values[name])
    return tuple(sorted(values.items(), key=lambda item: item[0]))


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
                   kernel: Optional[Kernel] = None, sinks: Any = None):
    """Differentiable, jit-able ``commlib.ring.ring_attention`` for JAX arrays.
    ``cu_seqlens`` must be concrete (a list or NumPy array: static under
    jit), and ``mask`` is (a ``commlib.sequence.masks.Mask``): which blocks are
    computed is decided at trace time. ``sinks`` [h] (one logit per query
    head) are differentiated: this rank's queries' share of their gradient
    (summed over the ranks, it is the whole)."""
    return _ring_attention(q, k, v, sinks, _settings(comm=comm, layout=layout, causal=causal,
                                              softmax_scale=softmax_scale, kernel=kernel,
                                              cu_seqlens=cu_seqlens, window=window, mask=mask,
                                              method=method))


def ulysses_attention(q, k, v, comm, *, layout: str, causal: bool,
                      softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                      window: Any = None, mask: Any = None, kernel: Optional[Kernel] = None,
                      sinks: Any = None):
    """Differentiable, jit-able ``commlib.ulysses.ulysses_attention`` for JAX
    arrays (``sinks`` as ``ring_attention``'s)."""
    return _ulysses_attention(q, k, v, sinks, _settings(comm=comm, layout=layout, causal=causal,
                                                 softmax_scale=softmax_scale, kernel=kernel,
                                                 cu_seqlens=cu_seqlens, window=window,
                                                 mask=mask))


def hybrid_attention(q, k, v, comm, ulysses_size: int, *, layout: str, causal: bool,
                     softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                     window: Any = None, mask: Any = None, method: str = "auto",
                     kernel: Optional[Kernel] = None, sinks: Any = None):
    """Differentiable, jit-able ``commlib.hybrid.hybrid_attention`` for JAX
    arrays (``commlib.hybrid.plan`` picks ``ulysses_size``; ``sinks`` as
    ``ring_attention``'s)."""
    return _hybrid_attention(q, k, v, sinks, _settings(comm=comm, ulysses_size=ulysses_size,
                                                layout=layout, causal=causal,
                                                softmax_scale=softmax_scale, kernel=kernel,
                                                cu_seqlens=cu_seqlens, window=window,
                                                mask=mask, method=method))
