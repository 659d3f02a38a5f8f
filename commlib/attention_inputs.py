"""Checks of attention inputs shared by Ring, Ulysses and the hybrid.

Each rank checks its own shards; the algorithms then hand any problem to
``Communicator.agree``, so that all ranks raise together."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence, Tuple

from .arrays import Native

Extra = Tuple[Tuple[str, Native, tuple], ...]


def check_qkv(q: Native, k: Native, v: Native, extra: Extra = ()) -> None:
    """q [b, s, h, d], k and v [b, s, hk, d] with h % hk == 0, one dtype, one
    side (host or CUDA), and the ``extra`` (name, array, shape) triples."""
    if {q.on_device, k.on_device, v.on_device} != {q.on_device}:
        raise ValueError("q, k and v must all be host arrays or all CUDA arrays")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.data.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.data.shape)}")
    (b, s, h, d), (kb, ks, hk, kd) = q.data.shape, k.data.shape
    if tuple(v.data.shape) != tuple(k.data.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.data.shape)} and "
                         f"{tuple(v.data.shape)}")
    if (kb, ks, kd) != (b, s, d):
        raise ValueError(f"q {tuple(q.data.shape)} and k {tuple(k.data.shape)} must agree on "
                         f"batch, local sequence length and head_dim")
    if h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hk}) for GQA/MQA")
    if q.dtype != q.data.dtype:
        raise ValueError(f"{q.dtype.name} CUDA arrays are not supported by the built-in block "
                         f"kernel (CuPy has no {q.dtype.name}); cast q, k and v to float16 or "
                         f"float32")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype.name}, "
                         f"{k.dtype.name}, {v.dtype.name}")
    for name, x, shape in extra:
        if tuple(x.data.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.data.shape)}")


def backward_extras(q: Native, dout: Native, out: Native, lse: Native) -> Extra:
    """What a backward pass checks beyond q, k, v: dout and out shaped like
    q, lse [b, h, s]."""
    b, s, h = q.data.shape[:3] if q.data.ndim == 4 else (0, 0, 0)
    return (("dout", dout, tuple(q.data.shape)), ("out", out, tuple(q.data.shape)),
            ("lse", lse, (b, h, s)))


def problem_of(check: Callable[..., None], *args) -> Optional[Exception]:
    """The ValueError ``check(*args)`` raises, or None."""
    try:
        check(*args)
    except ValueError as error:
        return error
    return None


def scale_of(q: Native, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.data.shape[-1])


def settings(*pairs: Sequence) -> Tuple[str, ...]:
    """``("causal=True", ...)`` for a fingerprint."""
    return tuple(f"{name}={value}" for name, value in pairs)
