"""How a dispatch's rows travel (``Wire``: x's rows as bytes, as they are or
FP8, and how the owner reads them back) and a dispatch or combine in flight
(``PendingMoE``). Shared by every dispatch path."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..namespace import as_bytes, contiguous, from_bytes, namespace
from .quantize import BLOCK, dequantize_fp8, quantize_fp8

__all__ = ["PendingMoE", "Wire", "row_bytes"]


class PendingMoE:
    """A dispatch or combine in flight: ``wait()`` gives its result, once.
    Dropped without a wait, its transfer fails the communicator, so the
    next call raises on every rank instead of hanging."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish: Optional[Callable[[], Any]] = finish

    def wait(self) -> Any:
        if self._finish is None:
            raise RuntimeError("this dispatch or combine was already waited on")
        finish, self._finish = self._finish, None
        return finish()


@dataclass
class Wire:
    """How x's rows travel: their bytes [T, n]; how the owner reads the
    received bytes back (x's rows, FP8 values and scales, or those already
    dequantized: once per received row, before the rows are expanded into
    one per expert); and how the expanded parts make ``expert_x``."""

    payload: Any
    decode: Callable[[Any], Tuple[Any, ...]]
    deliver: Callable[[Tuple[Any, ...]], Any]

    @classmethod
    def of(cls, x: Any, quantize: Optional[str], dequantize: bool) -> "Wire":
        """x's rows as the bytes that travel and how the owner reads them:
        x's dtype as is, or FP8 (the scales' bytes, then the values')."""
        row_shape = tuple(x.shape[1:])

        def single(parts):
            return parts[0]
        if quantize is None:
            return cls(as_bytes(contiguous(x)),
                       lambda raw: (from_bytes(raw, x.dtype, row_shape),), single)
        values, scales = quantize_fp8(x)
        split, blocks = scales.shape[1] * 4, tuple(scales.shape[1:])
        xp = namespace(x)

        def decode(raw):
            parts = (from_bytes(raw[:, split:], values.dtype, row_shape),
                     from_bytes(raw[:, :split], xp.float32, blocks))
            return (dequantize_fp8(*parts, x.dtype),) if dequantize else parts
        return cls(xp.concat([as_bytes(scales), as_bytes(values)], axis=1), decode,
                   single if dequantize else tuple)


def row_bytes(x: Any, quantize: Optional[str]) -> int:
    """A row's bytes on the wire (``Wire.of(x, quantize, ...).payload``'s
    width), from x's shape and dtype alone: what a traced graph's fake
    tensors know."""
    values = math.prod(x.shape[1:])
    if quantize is None:
        return values * x.itemsize
    channels = x.shape[-1]
    return values + 4 * (values // max(channels, 1)) * -(-channels // BLOCK)
