"""commlib's collectives as operations of a jitted JAX program.

``TracedComm`` stands in for a Communicator while JAX traces: the algorithms
of commlib (ring, Ulysses, the hybrid, written over the caller's array
namespace) run on it unchanged, so their compute is jnp traced by XLA and
only the bytes cross into Python. Each transfer is one
``jax.experimental.buffer_callback``: the callback receives XLA's own
buffers (on the CPU NumPy views of them, no copy; on a GPU CuPy views, with
CuPy's current stream set to XLA's, so NCCL is ordered on it without a host
wait) and the real Communicator writes into XLA's output buffer. Deadlines,
failure notices and the runtime checks of the Communicator stay in force.

Order: every rank must run the same transfers in the same order, and XLA
schedules independent operations as it likes (its schedule differs between
ranks, whose programs differ: a ring rank skips blocks its causal mask
hides). Within one ``ordered()`` block the transfers are chained by a token
(each callback takes the previous one's token and makes the next). The
blocks are ordered among themselves by JAX's ordered effects: a block's
chain starts from an ordered ``io_callback`` and ends in one, and JAX runs
ordered callbacks in program order (forward calls in order, then the
backward ones in reverse, across ``custom_vjp``, ``scan`` and separate jitted
calls). Without that, the backward's first K/V shift of one rank, which
depends on no forward result, met the forward's shift of another.

Two communicators, split from the user's once (``traced``): "jax.runtime"
carries the transfers, with the user's transport (NCCL on GPUs);
"jax.checks" carries the checks of shapes and arguments (``agree``), which
run once, when JAX traces, so that tracing one function while another runs
cannot mix their messages. The checks move only host integers, so that
communicator is split with ``backend="mpi"``: no NCCL communicator or
stream of its own.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.buffer_callback import buffer_callback

# dtypes whose bytes cross as unsigned integers of the same size: CuPy has no
# bfloat16 or float8, and bytes are all a transfer moves
_AS_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}

_CUPY_LACKS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")

_traced: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def traced(comm) -> "TracedComm":
    """The TracedComm of ``comm``, made once (collective: every rank makes it
    at its first trace)."""
    if isinstance(comm, TracedComm):
        return comm
    if comm not in _traced:
        _traced[comm] = TracedComm(
            comm.split(0, comm.rank, cache_key="jax.runtime"),
            comm.split(0, comm.rank, cache_key="jax.checks", backend="mpi"), _Chain())
    return _traced[comm]


class _Chain:
    """The token that orders a traced function's transfers."""

    def __init__(self):
        self.token = None


def _program_order(token=None):
    """A token from an ordered ``io_callback`` that depends on ``token``:
    JAX runs these in program order on every rank."""
    operands = () if token is None else (token,)
    return io_callback(_next_token, jax.ShapeDtypeStruct((), jnp.uint8), *operands,
                       ordered=True)


def _next_token(*_):
    return np.zeros((), np.uint8)


def _view(buffer, on_gpu: bool):
    """A NumPy (CPU) or CuPy (GPU) array over an XLA buffer, without a copy."""
    if on_gpu:
        import cupy
        return cupy.asarray(buffer)
    return np.asarray(buffer)


def _bits(x):
    """``x`` as unsigned integers of its itemsize where the callback could
    not view it otherwise: bfloat16 and float8 on a GPU (CuPy has neither).
    Elsewhere ``x`` itself: a bitcast can make XLA copy the buffer."""
    if jax.default_backend() != "gpu" or x.dtype.name not in _CUPY_LACKS:
        return x
    return jax.lax.bitcast_convert_type(x, _AS_BITS[x.dtype.itemsize])


def _unbits(x, dtype):
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


class TracedPending:
    """A shift whose transfer is already in the program; ``wait()`` gives it."""

    def __init__(self, result):
        self._result = result

    def wait(self):
        return self._result


class TracedComm:
    """The Communicator methods commlib's algorithms use, for traced JAX
    arrays. ``runtime`` carries the transfers, ``checks`` the trace-time
    agreement; both are duplicates of the user's communicator, ``checks``
    without a device transport (``traced``)."""

    def __init__(self, runtime, checks, chain: _Chain):
        self.runtime, self.checks, self._chain = runtime, checks, chain

    rank = property(lambda self: self.runtime.rank)
    size = property(lambda self: self.runtime.size)
    backend = property(lambda self: self.runtime.backend)
    topology = property(lambda self: self.runtime.topology)

    @contextlib.contextmanager
    def ordered(self) -> Iterator[None]:
        """Chain the transfers traced inside the block (one traced function),
        after every earlier block of the program and before every later one."""
        outer = self._chain.token
        self._chain.token = _program_order()
        try:
            yield
            _program_order(self._chain.token)
        finally:
            self._chain.token = outer

    def split(self, color: int, key: int = 0, *, cache_key: Any = None) -> "TracedComm":
        """Sub-communicators, made when tracing (with a ``cache_key``: once,
        owned by the communicator); their transfers join the same chain."""
        return TracedComm(self.runtime.split(color, key, cache_key=cache_key),
                          self.checks.split(color, key, cache_key=cache_key, backend="mpi"),
                          self._chain)

    def agree(self, op: str, *facts: Any, problem: Optional[Exception] = None) -> None:
        self.checks.agree(op, *facts, problem=problem)

    def fingerprint(self, **params: Any):
        return self.checks.fingerprint(**params)

    # -- transfers ----------------------------------------------------------
    def _call(self, transfer, shapes: Sequence[jax.ShapeDtypeStruct], *operands) -> List[Any]:
        """``transfer(outs, *ins)`` on NumPy/CuPy views of XLA's buffers, in
        the chain: returns the traced outputs."""
        chain = self._chain
        if chain.token is None:
            raise RuntimeError("commlib JAX transfers must be traced inside "
                               "TracedComm.ordered() (the bindings do this)")

        callback = functools.partial(_transfer_on_xla_stream, transfer)
        results = buffer_callback(callback, (jax.ShapeDtypeStruct((), jnp.uint8),) + tuple(shapes),
                                  has_side_effect=True)(chain.token, *operands)
        chain.token = results[0]
        return list(results[1:])

    def ring_shift_async(self, x, shift: int = 1, lane: int = 0) -> TracedPending:
        bits = _bits(x)

        def transfer(outs, send):
            self.runtime.ring_shift_async(send, shift, lane, out=outs[0]).wait()
        out, = self._call(transfer, [jax.ShapeDtypeStruct(bits.shape, bits.dtype)], bits)
        return TracedPending(_unbits(out, x.dtype))

    def ring_shift(self, x, shift: int = 1):
        return self.ring_shift_async(x, shift).wait()

    def alltoall(self, x, split_axis: int = 0, concat_axis: int = 0):
        """The layout changes in jnp, the exchange of equal chunks in the
        callback."""
        size = self.size
        split_axis, concat_axis = split_axis % x.ndim, concat_axis % x.ndim
        length = x.shape[split_axis]
        if length % size:
            raise ValueError(f"alltoall splits axis {split_axis} (length {length}) into "
                             f"{size} equal chunks; make that axis a multiple of {size}")
        send = _bits(jnp.moveaxis(x, split_axis, 0))

        def transfer(outs, data):
            self.runtime.alltoall(data, out=outs[0])
        received, = self._call(transfer, [jax.ShapeDtypeStruct(send.shape, send.dtype)], send)
        received = _unbits(received, x.dtype)
        chunked = received.reshape((size, length // size) + received.shape[1:])
        blocks = jnp.moveaxis(chunked, 1, split_axis + 1)
        shape = list(blocks.shape[1:])
        shape[concat_axis] *= size
        return jnp.moveaxis(blocks, 0, concat_axis).reshape(shape)

    def alltoall_many(self, arrays: Sequence[Any]) -> List[Any]:
        """One exchange for several arrays: their bytes packed per peer."""
        size = self.size
        parts = [jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(size, -1) for a in arrays]
        packed = jnp.concatenate(parts, axis=1)

        def transfer(outs, data):
            self.runtime.alltoall(data, out=outs[0])
        out, = self._call(transfer, [jax.ShapeDtypeStruct(packed.shape, packed.dtype)], packed)
        results, offset = [], 0
        for a, part in zip(arrays, parts):
            block = out[:, offset:offset + part.shape[1]]
            offset += part.shape[1]
            if a.dtype.itemsize > 1:
                block = block.reshape(size, -1, a.dtype.itemsize)
            results.append(jax.lax.bitcast_convert_type(block, a.dtype).reshape(a.shape))
        return results

    def alltoallv(self, x, send_counts: Any, recv_counts: Any = None):
        """Variable rows along axis 0, as ``Communicator.alltoallv``, with
        both counts known when tracing (a jitted program's shapes are): no
        count exchange, the caller's ``recv_counts`` size the result."""
        if recv_counts is None:
            raise ValueError("alltoallv under jax.jit needs recv_counts: the result's shape "
                             "is fixed when tracing, so pass the rows each rank sends here")
        send, recv = ([int(n) for n in np.asarray(c).reshape(-1)]
                      for c in (send_counts, recv_counts))
        if len(send) != self.size or len(recv) != self.size or sum(send) != x.shape[0]:
            raise ValueError(f"alltoallv needs {self.size} send and receive counts, the send "
                             f"counts summing to x's {x.shape[0]} rows; got {send} and {recv}")
        bits = _bits(x)

        def transfer(outs, data):
            outs[0][...] = self.runtime.alltoallv(data, send, recv)[0]
        out, = self._call(transfer, [jax.ShapeDtypeStruct((sum(recv),) + bits.shape[1:],
                                                          bits.dtype)], bits)
        return _unbits(out, x.dtype), np.array(recv, np.int64)

    def allgather(self, x, axis: int = 0):
        bits = _bits(x)

        def transfer(outs, data):
            outs[0][...] = self.runtime.allgather(data[None], axis=0)
        out, = self._call(transfer, [jax.ShapeDtypeStruct((self.size,) + bits.shape,
                                                          bits.dtype)], bits)
        out = _unbits(out, x.dtype)
        return jnp.concatenate(list(out), axis=axis)


def _transfer_on_xla_stream(transfer, ctx, outs, token, *ins) -> None:
    """A transfer's ``buffer_callback``: ``transfer(targets, *views)`` on views
    of XLA's buffers, then the chain's token copied on, both with CuPy's
    current stream set to XLA's (on a GPU): on CuPy's default stream the token
    copy would be unordered with XLA's non-blocking streams."""
    stream = _stream_of(ctx)
    on_gpu = stream is not None
    with _on_stream(stream):
        transfer([_view(b, on_gpu) for b in outs[1:]], *[_view(b, on_gpu) for b in ins])
        _view(outs[0], on_gpu)[...] = _view(token, on_gpu)


def _stream_of(ctx) -> Optional[int]:
    """XLA's CUDA stream for a program on a GPU; None for one on the CPU
    (which can run on a machine whose default backend is a GPU)."""
    try:
        return ctx.stream
    except jax.errors.JaxRuntimeError:  # "XLA FFI GPU context is not available"
        return None


@contextlib.contextmanager
def _on_stream(stream_ptr):
    """CuPy's current stream set to XLA's (on a GPU), so commlib's NCCL calls
    are ordered on it; nothing on the CPU."""
    if stream_ptr is None:
        yield
        return
    import cupy
    with cupy.cuda.ExternalStream(stream_ptr):
        yield
