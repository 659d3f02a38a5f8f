"""Checks of attention inputs shared by Ring, Ulysses and the hybrid.

Each rank checks its own shards (arrays of any one framework); the
algorithms then hand any problem to ``Communicator.agree`` through
``agree_on_inputs``, so that all ranks raise together."""

from __future__ import annotations

import math
import zlib
from typing import Any, Callable, Optional, Tuple

from .documents import Packing, packing_for
from .namespace import dtype_name, framework_of, on_cuda
from .visibility import bounds

Extra = Tuple[Tuple[str, Any, tuple], ...]

ATTENTION_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_qkv(q: Any, k: Any, v: Any, extra: Extra = ()) -> None:
    """q [b, s, h, d], k and v [b, s, hk, d] with h % hk == 0, one framework,
    one dtype, one side (host or CUDA), and the ``extra`` (name, array,
    shape) triples."""
    kinds = {name: framework_of(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(kinds.values())) != 1:
        raise ValueError(f"q, k and v must come from one framework, got "
                         f"{', '.join(f'{n}: {f}' for n, f in kinds.items())}")
    if len({on_cuda(q), on_cuda(k), on_cuda(v)}) != 1:
        raise ValueError("q, k and v must all be host arrays or all CUDA arrays")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape "
                             f"{tuple(x.shape)}")
    (b, s, h, d), (kb, ks, hk, kd) = q.shape, k.shape
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    if (kb, ks, kd) != (b, s, d):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on "
                         f"batch, local sequence length and head_dim")
    if hk == 0 or h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hk}) for GQA/MQA")
    names = [dtype_name(x) for x in (q, k, v)]
    if len(set(names)) != 1:
        raise ValueError(f"q, k and v must have one dtype, got {', '.join(names)}")
    if names[0] not in ATTENTION_DTYPES:
        raise ValueError(f"attention takes q, k and v of {', '.join(ATTENTION_DTYPES)}, got "
                         f"{names[0]}; cast them first")
    for name, x, shape in extra:
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def backward_extras(q: Any, dout: Any, out: Any, lse: Any) -> Extra:
    """What a backward pass checks beyond q, k, v: dout and out shaped like
    q, lse [b, h, s]."""
    b, s, h = tuple(q.shape[:3]) if len(q.shape) == 4 else (0, 0, 0)
    return (("dout", dout, tuple(q.shape)), ("out", out, tuple(q.shape)),
            ("lse", lse, (b, h, s)))


def problem_of(check: Callable[..., None], *args) -> Optional[Exception]:
    """The ValueError ``check(*args)`` raises, or None."""
    try:
        check(*args)
    except ValueError as error:
        return error
    return None


def scale_of(q: Any, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def prepare(comm, op: str, q: Any, k: Any, check: Callable[[], None], layout: str,
            causal: bool, cu_seqlens: Any, window: Any, **settings: Any):
    """Check the inputs on this rank (``check()``: the algorithm's own
    checks, raising ValueError), agree on them and on every setting with
    every rank (any problem raises on all), and return what decides which
    pairs are visible: (packing, (lo, hi)) (``commlib.documents``,
    ``commlib.visibility``)."""
    packing = visible = None
    problem = None
    try:
        check()
        packing = packing_for(cu_seqlens, layout, comm.size, q.shape[1])
        visible = bounds(causal, window)
    except ValueError as error:
        problem = error
    agree_on_inputs(comm, op, q, k, problem, causal=causal, layout=layout, window=window,
                    documents=_documents(packing), **settings)
    return packing, visible


def _documents(packing: Optional[Packing]) -> str:
    """A short digest of the documents, for the cross-rank agreement."""
    if packing is None:
        return "unreadable"
    return f"{len(packing.offsets) - 1} docs/{zlib.crc32(repr(packing.offsets).encode())}"


def agree_on_inputs(comm, op: str, q: Any, k: Any, problem: Optional[Exception],
                    **settings: Any) -> None:
    """All ranks must call ``op`` with the same shapes (local sequence
    lengths included), dtype and ``settings``, and none may have a
    ``problem`` with its own inputs; otherwise every rank raises
    ``CollectiveMismatchError``."""
    described = tuple(f"{name}={value}" for name, value in settings.items())
    comm.agree(op, tuple(getattr(q, "shape", ())), tuple(getattr(k, "shape", ())),
               _dtype_or_type(q), *described, problem=problem)


def _dtype_or_type(x: Any) -> str:
    try:
        return dtype_name(x)
    except (TypeError, AttributeError):
        return type(x).__name__
