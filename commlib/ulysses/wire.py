"""How Ulysses' all-to-all messages travel: in the input dtype
(``wire=None``), or as float8 e4m3 with float32 scales (``wire="float8"``,
xDiT's FP8 all-to-all), half the bytes of bfloat16.

A message is what one rank sends one peer: a [b, rows, n, d] chunk of the
send layout [P, b, rows, n, d] (q, k or v heads for seq_to_head, the
output's sequence chunk for head_to_seq). Each (batch, head) of a message
gets one scale, amax over its rows and head_dim / 448 (``commlib.fp8``):

- per head, because heads differ in scale (an outlier head would otherwise
  push every other head towards e4m3's subnormals), and per batch element,
  because a batch may stack unlike inputs (classifier-free guidance's two
  prompts); 4 bytes per (batch, head) of a message, nothing per token;
- not per token: e4m3 is a floating-point format, so a value keeps its 2**-4
  relative precision down to 2**-15 of its head's amax, and what is smaller
  hardly moves a softmax or an attention output; per token would cost 4
  bytes every head_dim values (3% at head_dim 128).

The scales travel with the values in the same message
(``Communicator.alltoall_many``), and the receiver multiplies them back
into the input dtype. Forward only: the bindings refuse it where gradients
are wanted (an FP8 forward beside a full-precision backward would give
gradients of another function).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from ..fp8 import fp8_dtype, scaled_e4m3, unscaled
from ..namespace import dtype_name, namespace

WIRES = (None, "float8")
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_wire(wire: Optional[str], x: Any) -> None:
    """A ValueError unless ``wire`` is one of ``WIRES`` and, for "float8",
    x's framework has float8 (CuPy has none) and x is floating-point."""
    if wire not in WIRES:
        raise ValueError(f"unknown wire={wire!r}; use None (the input dtype travels) or "
                         f"'float8' (e4m3 with a float32 scale per batch and head)")
    if wire is None:
        return
    try:
        fp8_dtype(x, instead="use wire=None")
    except TypeError as error:
        raise ValueError(str(error)) from None
    if dtype_name(x) not in WIRE_DTYPES:
        raise ValueError(f"wire='float8' quantizes floating-point arrays "
                         f"({', '.join(WIRE_DTYPES)}), got {dtype_name(x)}")


def relay(comm, sends: Sequence[Any], wire: Optional[str], fused: bool,
          asynchronous: bool = False) -> Callable[[], List[Any]]:
    """Start the all-to-all of each send layout [P, ...] (chunk p to rank
    p) as ``wire`` says, and return the wait, which gives each one's
    received [P, ...] (chunk p from rank p) in its own dtype. ``fused``:
    one message per peer for all the sends, else one per send (a send's
    values and scales always share one). ``asynchronous``: posted now,
    moved while the caller computes, finished by the wait."""
    messages = [_encoded(send, wire) for send in sends]
    batches = [[part for message in messages for part in message]] if fused else messages
    if asynchronous:
        pending = [comm.alltoall_many_async(batch) for batch in batches]
        def arrived() -> List[Any]:
            return [part for p in pending for part in p.wait()]
    else:
        done = [part for batch in batches
                for part in (comm.alltoall_many(batch) if len(batch) > 1
                             else [comm.alltoall(batch[0])])]
        def arrived() -> List[Any]:
            return done

    def wait() -> List[Any]:
        parts, results = arrived(), []
        for send, message in zip(sends, messages):
            results.append(_decoded(parts[:len(message)], wire, send.dtype))
            parts = parts[len(message):]
        return results
    return wait


def _encoded(send: Any, wire: Optional[str]) -> List[Any]:
    """What travels for the send layout [P, b, rows, n, d]: itself, or its
    e4m3 values and scales [P, b, n]."""
    if wire is None:
        return [send]
    values, scales = scaled_e4m3(send, (2, 4))
    size, batch, _, heads, _ = send.shape
    return [values, namespace(send).reshape(scales, (size, batch, heads))]


def _decoded(parts: List[Any], wire: Optional[str], dtype: Any) -> Any:
    if wire is None:
        return parts[0]
    values, scales = parts
    size, batch, _, heads, _ = values.shape
    return unscaled(values, namespace(values).reshape(scales, (size, batch, 1, heads, 1)),
                    dtype)
