"""JAX operations over commlib, usable inside ``jax.jit`` and
differentiable with ``jax.grad`` (``jax.custom_vjp``), as one XLA program.

The algorithms are commlib's own (ring, Ulysses, the hybrid), traced by JAX
on a ``TracedComm`` (``bindings/jax_collectives.py``): the schedule, the
merge, the relayouts and the block kernel are jnp in the jitted program, on
the arrays' device; only the transfers leave it, as buffer callbacks that
hand XLA's buffers to the real Communicator (no copy on the CPU; on a GPU on
XLA's stream). Forward and backward are both traced; the forward keeps
``out`` and ``lse`` for the backward. Shapes and arguments are checked on
every rank when JAX traces.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from commlib import hybrid as _hybrid
from commlib import ring as _ring
from commlib import ulysses as _ulysses
from commlib.kernels import Kernel

from .jax_collectives import traced

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "Dispatcher"]


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _differentiable(forward, backward):
    """A custom_vjp attention from a core forward (returning out, lse) and
    backward, both traced on the TracedComm of ``settings``' communicator;
    ``settings`` (communicator, flags) are not differentiated."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def attend(q, k, v, settings):
        return _forward(q, k, v, settings)[0]

    def _forward(q, k, v, settings):
        options = dict(settings)
        comm = traced(options.pop("comm"))
        with comm.ordered():
            return forward(q, k, v, comm=comm, return_lse=True, **options)

    def attend_fwd(q, k, v, settings):
        out, lse = _forward(q, k, v, settings)
        return out, (q, k, v, out, lse)

    def attend_bwd(settings, saved, dout):
        options = dict(settings)
        comm = traced(options.pop("comm"))
        with comm.ordered():
            return tuple(backward(dout, *saved, comm=comm, **options))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


_ring_attention = _differentiable(_ring.ring_attention, _ring.ring_attention_backward)
_ulysses_attention = _differentiable(_ulysses.ulysses_attention,
                                     _ulysses.ulysses_attention_backward)
_hybrid_attention = _differentiable(_hybrid.hybrid_attention, _hybrid.hybrid_attention_backward)


def _settings(**values):
    """Hashable settings for nondiff_argnums (the communicator by identity)."""
    return tuple(sorted(values.items(), key=lambda item: item[0]))


def ring_attention(q, k, v, comm, causal: bool = False, layout: str = "contiguous",
                   softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None):
    """Differentiable, jit-able ``commlib.ring.ring_attention`` for JAX arrays."""
    return _ring_attention(q, k, v, _settings(comm=comm, causal=causal, layout=layout,
                                              softmax_scale=softmax_scale, kernel=kernel))


def ulysses_attention(q, k, v, comm, causal: bool = False,
                      softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None):
    """Differentiable, jit-able ``commlib.ulysses.ulysses_attention`` for JAX arrays."""
    return _ulysses_attention(q, k, v, _settings(comm=comm, causal=causal,
                                                 softmax_scale=softmax_scale, kernel=kernel))


def hybrid_attention(q, k, v, comm, ulysses_size: int, causal: bool = False,
                     softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None):
    """Differentiable, jit-able ``commlib.hybrid.hybrid_attention`` for JAX
    arrays (contiguous shards; ``commlib.hybrid.plan`` picks ``ulysses_size``)."""
    return _hybrid_attention(q, k, v, _settings(comm=comm, ulysses_size=ulysses_size,
                                                causal=causal, softmax_scale=softmax_scale,
                                                kernel=kernel))


# -- MoE under jit: fixed capacity, drop-and-pad ------------------------------

class Dispatcher:
    """MoE dispatch and combine for JAX, jit-able and differentiable.

    JAX shapes are static, so every expert takes at most ``capacity`` rows
    from each source rank (``capacity_factor`` is required; overflow is
    dropped and counted in ``stats``), and ``dispatch`` returns
    ``expert_x`` padded to [local_experts, size * capacity, H] with zero rows.
    ``combine`` takes ``expert_y`` in that layout. The host-side state of a
    dispatch lives in a small registry keyed by the id ``dispatch`` returns
    (the last ``keep`` dispatches are kept).
    """

    def __init__(self, comm, num_experts: int, capacity_factor: float,
                 drop_policy: str = "probs", hierarchical: bool = False, keep: int = 64):
        from commlib import moe

        if capacity_factor is None:
            raise ValueError("JAX shapes are static: give a capacity_factor (drop-and-pad)")
        self.core = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                                   drop_policy=drop_policy, hierarchical=hierarchical)
        self.comm, self.keep = comm, keep
        self._handles: dict = {}
        self._next = 0
        self.dispatch = jax.custom_vjp(self._dispatch)
        self.dispatch.defvjp(self._dispatch_fwd, self._dispatch_bwd)
        self.combine = jax.custom_vjp(self._combine)
        self.combine.defvjp(self._combine_fwd, self._combine_bwd)

    @property
    def stats(self):
        return self.core.stats

    def slots(self, tokens: int, k: int) -> int:
        """Rows per local expert in the padded layout."""
        return self.comm.size * self.core._capacity(tokens, k)

    # host side ---------------------------------------------------------------
    def _remember(self, handle, slots: int) -> int:
        starts = np.concatenate([[0], np.cumsum(handle.tokens_per_expert)[:-1]])
        expert = np.repeat(np.arange(len(handle.tokens_per_expert)), handle.tokens_per_expert)
        position = np.arange(expert.size) - starts[expert]
        key, self._next = self._next, self._next + 1
        self._handles[key] = (handle, expert * slots + position)
        for old in [k for k in self._handles if k <= key - self.keep]:
            del self._handles[old]
        return key

    def _host_dispatch(self, x, experts, weights):
        x = np.asarray(x)
        expert_x, handle = self.core.dispatch(x, np.asarray(experts), np.asarray(weights))
        slots = self.slots(*np.asarray(experts).shape)
        padded = np.zeros((self.core.local_experts * slots,) + x.shape[1:], x.dtype)
        key = self._remember(handle, slots)
        padded[self._handles[key][1]] = expert_x
        return padded.reshape((self.core.local_experts, slots) + x.shape[1:]), np.int32(key)

    def _host_dispatch_grad(self, key, grad):
        handle, where = self._handles[int(key)]
        grad = np.asarray(grad)
        return self.core.dispatch_backward(grad.reshape((-1,) + grad.shape[2:])[where], handle)

    def _host_combine(self, key, expert_y):
        handle, where = self._handles[int(key)]
        expert_y = np.asarray(expert_y)
        return self.core.combine(expert_y.reshape((-1,) + expert_y.shape[2:])[where], handle)

    def _host_combine_grad(self, key, expert_y, grad, weights):
        handle, where = self._handles[int(key)]
        expert_y, weights = np.asarray(expert_y), np.asarray(weights)
        rows = expert_y.reshape((-1,) + expert_y.shape[2:])[where]
        d_rows, d_weights = self.core.combine_backward(rows, np.asarray(grad), handle,
                                                       weights.shape[1])
        d_expert_y = np.zeros((expert_y.shape[0] * expert_y.shape[1],) + expert_y.shape[2:],
                              expert_y.dtype)
        d_expert_y[where] = d_rows
        return d_expert_y.reshape(expert_y.shape), d_weights.astype(weights.dtype)

    # traced side ---------------------------------------------------------------
    def _dispatch(self, x, experts, weights):
        return self._dispatch_fwd(x, experts, weights)[0]

    def _dispatch_fwd(self, x, experts, weights):
        slots = self.slots(*experts.shape)
        shapes = (_struct((self.core.local_experts, slots) + x.shape[1:], x.dtype),
                  _struct((), jnp.int32))
        expert_x, key = io_callback(self._host_dispatch, shapes, x, experts, weights,
                                    ordered=True)
        return (expert_x, key), (key, x, experts, weights)

    def _dispatch_bwd(self, saved, cotangents):
        key, x, experts, weights = saved
        dx = io_callback(self._host_dispatch_grad, _struct(x.shape, x.dtype), key,
                         cotangents[0], ordered=True)
        return dx, np.zeros(experts.shape, jax.dtypes.float0), jnp.zeros_like(weights)

    def _combine(self, expert_y, weights, key):
        return self._combine_fwd(expert_y, weights, key)[0]

    def _combine_fwd(self, expert_y, weights, key):
        shape = (weights.shape[0],) + expert_y.shape[2:]
        y = io_callback(self._host_combine, _struct(shape, expert_y.dtype), key, expert_y,
                        ordered=True)
        return y, (key, expert_y, weights)

    def _combine_bwd(self, saved, grad):
        key, expert_y, weights = saved
        shapes = (_struct(expert_y.shape, expert_y.dtype), _struct(weights.shape, weights.dtype))
        d_expert_y, d_weights = io_callback(self._host_combine_grad, shapes, key, expert_y,
                                            grad, weights, ordered=True)
        return d_expert_y, d_weights, np.zeros((), jax.dtypes.float0)
