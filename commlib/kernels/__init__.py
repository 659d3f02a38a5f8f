"""Block attention kernels: the only part of Ring, Ulysses and the hybrid
that is chosen per framework.

A ``Kernel`` is a pair of functions on [batch, seq, heads, head_dim] arrays
of one framework:

- ``forward(q, k, v, causal, scale) -> (out, lse)``: out like q (its dtype
  or wider), lse [b, h, s] float32 (float64 for float64 inputs:
  ``namespace.accumulator_dtype``; a narrower one loses precision);
- ``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``,
  where ``out`` and ``lse`` are the *global* ones (over all keys of the
  ring), so that the result is this block's exact share of the gradients.

Packed documents and sliding windows add a keyword, ``mask=`` (bool
[queries, keys] in q's framework, True = visible; a row may see no key:
out 0, lse -inf), passed only for blocks that need it: a kernel without
it serves unmasked attention.

``causal`` is the flash-attention convention for equal query and key
lengths. k and v may have fewer heads than q (GQA): dk and dv come back with
k's heads. ``kernel_for(q)`` picks the best built-in kernel for q's
framework, device and dtype: PyTorch's fused SDPA ops for torch, the tiled
array-API kernel for NumPy and CuPy, and the same kernel compiled by XLA for
JAX. Pass your own ``Kernel`` (``kernel=``) to any attention function to use
another (flash-attn's, say: docs/ring.md has a worked adapter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Tuple

from .. import graph_names
from ..namespace import framework, on_cuda
from . import tiled

Forward = Callable[[Any, Any, Any, bool, float], Tuple[Any, Any]]
Backward = Callable[[Any, Any, Any, Any, Any, Any, bool, float], Tuple[Any, Any, Any]]


@dataclass(frozen=True)
class Kernel:
    """A block attention kernel pair (see the module docstring)."""

    forward: Forward
    backward: Backward
    name: str = "custom"

    def __post_init__(self):
        # what a compiled graph's ops name this kernel by (commlib.graph_names)
        object.__setattr__(self, "handle", graph_names.name("kernel", self))


TILED = Kernel(tiled.attention_forward, tiled.attention_backward, "tiled")


@functools.lru_cache(maxsize=None)
def _torch_kernel() -> Kernel:
    from . import torch_sdpa
    return Kernel(torch_sdpa.forward, torch_sdpa.backward, "torch-sdpa")


@functools.lru_cache(maxsize=2)
def _jax_kernel(cuda: bool) -> Kernel:
    """The tiled kernel traced and compiled by XLA (once per shape)."""
    import jax

    statics = ("causal", "softmax_scale")
    forward = jax.jit(functools.partial(tiled.attention_forward, cuda=cuda),
                      static_argnames=statics)
    backward = jax.jit(functools.partial(tiled.attention_backward, cuda=cuda),
                       static_argnames=statics)
    return Kernel(lambda q, k, v, causal, scale, mask=None: forward(
                      q, k, v, causal=causal, softmax_scale=scale, mask=mask),
                  lambda dout, q, k, v, out, lse, causal, scale, mask=None: backward(
                      dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, mask=mask),
                  "jax-tiled")


def kernel_for(q: Any) -> Kernel:
    """The built-in kernel for q's framework, device and dtype."""
    kind = framework(q)
    if kind == "torch":
        return _torch_kernel()
    if kind == "jax":
        return _jax_kernel(on_cuda(q))
    return TILED


__all__ = ["Kernel", "kernel_for", "TILED"]
