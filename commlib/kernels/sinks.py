"""Attention sinks (gpt-oss): one learned logit per query head that joins
every softmax as an extra column with no value.

Query i of head h then weighs key j by exp(s_ij) / (sum_j exp(s_ij) +
exp(sink_h)): the sink takes a share of the attention and returns nothing.
Over (out, lse) merged from every key block (``merge.py`` stays sink-free),
the sink enters once, at the end:

    lse' = logaddexp(lse, sink_h),    out' = out * exp(lse - lse')

(a row that saw no key keeps out 0, and its lse' is the sink). The
backward needs nothing new for dq, dk and dv: the usual backward, given the
final out' and lse', is already the gradient of the softmax with the sink
column (P = exp(s - lse'); D = rowsum(dO * O') counts the sink's share). The
sink's own gradient is the one new term:

    dsink_h = -sum over (batch, query) of exp(sink_h - lse') * rowsum(dO * O')

summed over whatever queries the caller holds: each rank its own, the
ranks' partials adding up to the whole (``sink_gradient``).

Written once over the array API and used by every method (ring, all-gather,
sparse, Ulysses, the hybrid, decode and chunk attention), in the
accumulator dtype (``namespace.accumulator_dtype``)."""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

from ..namespace import accumulator_dtype, dtype_name, framework, framework_of, namespace, on_cuda

SINK_DTYPES = ("float16", "bfloat16", "float32", "float64")


def check_sinks(sinks: Any, q: Any) -> None:
    """``sinks``: None, or one logit per query head of ``q`` [b, s, h, d]
    (shape (h,), floating) in q's framework, on q's device; else a
    ValueError saying what was wrong."""
    if sinks is None:
        return
    kind = framework_of("sinks", sinks)
    if kind != framework(q):
        raise ValueError(f"sinks must be an array of q's framework ({framework(q)}), got a "
                         f"{kind} array")
    if on_cuda(sinks) != on_cuda(q) or (kind == "torch" and sinks.device != q.device):
        raise ValueError(f"sinks must be on q's device ({_device_name(q)}), got "
                         f"{_device_name(sinks)}")
    heads = q.shape[2]
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape ({heads},): one logit per query head of q "
                         f"(all of q's heads, as every rank holds them), got "
                         f"{tuple(sinks.shape)}")
    if dtype_name(sinks) not in SINK_DTYPES:
        raise ValueError(f"sinks must be floating ({', '.join(SINK_DTYPES)}), got "
                         f"{dtype_name(sinks)}")


def _device_name(x: Any) -> str:
    if framework(x) == "torch":
        return str(x.device)
    return "CUDA" if on_cuda(x) else "host"


def sinks_fact(sinks: Any) -> str:
    """What every rank must agree on about its ``sinks``: whether it has
    them, their shape and dtype (their values are the caller's: a
    replicated parameter, like the projections' weights)."""
    if sinks is None:
        return "none"
    return f"{tuple(getattr(sinks, 'shape', ()))}/{getattr(sinks, 'dtype', type(sinks))}"


def apply_sinks(out: Any, lse: Any, sinks: Optional[Any]) -> Tuple[Any, Any]:
    """(out', lse') of a finished (out [b, s, h, d], lse [b, h, s]) with
    the sinks [h] of its heads in its softmax, in the accumulator dtype;
    (out, lse) themselves without sinks."""
    if sinks is None:
        return out, lse
    xp = namespace(out)
    wide = accumulator_dtype(out, lse)
    lse = xp.astype(lse, wide, copy=False)
    with_sink = xp.logaddexp(lse, _per_row(xp, sinks, wide))
    kept = xp.exp(lse - _finite(xp, with_sink))  # the keys' share of the attention
    scaled = xp.astype(out, wide, copy=False) * xp.permute_dims(kept, (0, 2, 1))[..., None]
    return scaled, with_sink


def sink_gradient(dout: Any, out: Any, lse: Any, sinks: Any) -> Any:
    """dsinks [h] in sinks' dtype, from this caller's queries: ``out`` and
    ``lse`` are the forward's (with the sinks), ``dout`` the output's
    gradient, all for the same queries ([b, s, h, d] and [b, h, s])."""
    xp = namespace(out)
    wide = accumulator_dtype(out, lse)
    lse = xp.astype(lse, wide, copy=False)
    d = xp.sum(xp.astype(dout, wide) * xp.astype(out, wide), axis=-1)  # [b, s, h]
    share = xp.exp(_per_row(xp, sinks, wide) - _finite(xp, lse))  # the sink's probability
    grad = -xp.sum(share * xp.permute_dims(d, (0, 2, 1)), axis=(0, 2))
    return xp.astype(grad, sinks.dtype)


def with_sink_gradient(grads: Tuple[Any, ...], dout: Any, out: Any, lse: Any,
                       sinks: Optional[Any]) -> Tuple[Any, ...]:
    """A backward's (dq, dk, dv), and dsinks after them where there are
    sinks: the spelling every attention backward returns."""
    if sinks is None:
        return tuple(grads)
    return (*grads, sink_gradient(dout, out, lse, sinks))


def _finite(xp: Any, lse: Any) -> Any:
    """``lse`` with -inf (no key and a -inf sink: nothing seen) as 0, so that
    exp(x - lse) of an x <= lse is exp(-inf) = 0 there, never exp(nan)."""
    return xp.where(lse == -math.inf, 0.0, lse)


def _per_row(xp: Any, sinks: Any, wide: Any) -> Any:
    """sinks [h] as [1, h, 1] in ``wide``, to meet an lse [b, h, s]."""
    return xp.reshape(xp.astype(sinks, wide), (1, -1, 1))
