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

Logit soft-capping (Gemma2, Grok) adds another, ``softcap=`` (a positive
float: scores s become cap * tanh(s / cap) after the scale, before the
masks and the softmax), passed only where a call sets it, and only to a
kernel that says it takes it (``Kernel.takes_softcap``). The tiled kernel
does (NumPy, CuPy, JAX, and torch); PyTorch's fused SDPA ops cannot, so
``kernel_for(q, softcap)`` gives torch the tiled kernel (run in torch)
when a cap is set, and ``capped`` refuses a kernel that cannot cap.

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
from typing import Any, Callable, Optional, Tuple

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
    takes_softcap: bool = False  # whether forward and backward take softcap=

    def __post_init__(self):
        # what a compiled graph's ops name this kernel by (commlib.graph_names)
        object.__setattr__(self, "handle", graph_names.name("kernel", self))


TILED = Kernel(tiled.attention_forward, tiled.attention_backward, "tiled", takes_softcap=True)


@functools.lru_cache(maxsize=None)
def _torch_kernel() -> Kernel:
    from . import torch_sdpa
    return Kernel(torch_sdpa.forward, torch_sdpa.backward, "torch-sdpa")


@functools.lru_cache(maxsize=2)
def _jax_kernel(cuda: bool) -> Kernel:
    """The tiled kernel traced and compiled by XLA (once per shape)."""
    import jax

    statics = ("causal", "softmax_scale", "softcap")
    forward = jax.jit(functools.partial(tiled.attention_forward, cuda=cuda),
                      static_argnames=statics)
    backward = jax.jit(functools.partial(tiled.attention_backward, cuda=cuda),
                       static_argnames=statics)
    return Kernel(lambda q, k, v, causal, scale, mask=None, softcap=None: forward(
                      q, k, v, causal=causal, softmax_scale=scale, mask=mask, softcap=softcap),
                  lambda dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None: backward(
                      dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, mask=mask,
                      softcap=softcap),
                  "jax-tiled", takes_softcap=True)


def kernel_for(q: Any, softcap: Optional[float] = None) -> Kernel:
    """The built-in kernel for q's framework, device and dtype (one that
    caps the scores where ``softcap`` is set: the tiled one for torch)."""
    kind = framework(q)
    if kind == "torch":
        return TILED if softcap is not None else _torch_kernel()
    if kind == "jax":
        return _jax_kernel(on_cuda(q))
    return TILED


def capped(kernel: Kernel, softcap: Optional[float]) -> Kernel:
    """``kernel`` with every call's scores capped at ``softcap`` (itself
    without a cap): what a call's options make of its kernel, so that the
    schedules above call it as any other. A ValueError where the kernel
    cannot cap (``takes_softcap``)."""
    if softcap is None:
        return kernel
    if not kernel.takes_softcap:
        raise ValueError(f"softcap={softcap}: the kernel {kernel.name!r} cannot cap the scores "
                         f"(Kernel.takes_softcap is False); leave kernel= out for the built-in "
                         f"one (the tiled kernel under a cap), or pass a kernel that takes "
                         f"softcap=")
    return _capped(kernel, softcap)


@functools.lru_cache(maxsize=64)
def _capped(kernel: Kernel, softcap: float) -> Kernel:
    """One capped kernel per (kernel, cap): its graph name made once."""
    return Kernel(functools.partial(kernel.forward, softcap=softcap),
                  functools.partial(kernel.backward, softcap=softcap),
                  f"{kernel.name}+softcap", takes_softcap=False)


__all__ = ["Kernel", "kernel_for", "capped", "TILED"]
