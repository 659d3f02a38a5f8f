"""Inference over a sharded KV cache as ``torch.library`` custom ops
(``commlib::decode_attention``, ``commlib::chunk_attention``), and
``DecodeCache``: a rank's shard in fixed buffers, for a decode step that
``torch.compile(fullgraph=True)`` traces without a break and without a
retrace as the cache grows, and that a CUDA graph can capture.

As in ``bindings.torch._attention_ops``, an op takes its communicator by
name (``commlib.graph_names``), the call's options in the schema they
derive (``AttentionOptions``: the kernel by name too) and its positions as
int64 tensors; its body is
the eager core (``commlib.inference``), its fake gives the shapes. Both
are forward-only: the core has no backward (inference), and an op called
on tensors that require grad returns a result without history.

Decode (``decode_attention`` here) always runs the core's device path: the
visible keys are a mask made on the device from the positions, so the
step reads nothing back from the GPU (no sync, nothing a CUDA graph could
not replay). A chunk (``chunk_attention``) reads its positions on the host
(the blocks it attends are chosen there): it compiles, it is not captured.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from commlib import graph_names
from commlib import inference as _inference
from commlib.inference.attention import chunk_attention_with, decode_attention_with
from commlib.kernels import Kernel
from commlib.namespace import accumulator_dtype
from commlib.sequence.options import AttentionOptions, graph_schema

from ._direct import runs_directly

__all__ = ["decode_attention", "chunk_attention", "DecodeCache"]

Positions = Union[torch.Tensor, Sequence[int], np.ndarray]


# the positions and the communicator, then the options' own fields
CALL = "Tensor q_positions, Tensor k_positions, str comm, " + graph_schema()


def _decode(q, k, v, sinks, q_positions, k_positions, comm, *values):
    out, lse = decode_attention_with(AttentionOptions.from_graph_values(*values), q, k, v,
                                     graph_names.lookup(comm), q_positions=q_positions,
                                     k_positions=k_positions, sinks=sinks)
    return out.contiguous(), lse.contiguous()


decode_attention_op = torch.library.custom_op(
    "commlib::decode_attention", _decode, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, {CALL}) -> (Tensor, Tensor)")
decode_attention_op.__doc__ = """(out, lse) of ``commlib.inference.decode_attention`` (device
positions)."""


@decode_attention_op.register_fake
def _decode_shapes(q, k, v, *statics):
    return _attention_shapes(q, v)


def _chunk(q, k, v, sinks, q_positions, k_positions, comm, *values):
    out, lse = chunk_attention_with(AttentionOptions.from_graph_values(*values), q, k, v,
                                    graph_names.lookup(comm),
                                    q_positions=q_positions.cpu().numpy(),
                                    k_positions=k_positions.cpu().numpy(), sinks=sinks)
    return out.contiguous(), lse.contiguous()


chunk_attention_op = torch.library.custom_op(
    "commlib::chunk_attention", _chunk, mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, {CALL}) -> (Tensor, Tensor)")
chunk_attention_op.__doc__ = """(out, lse) of ``commlib.inference.chunk_attention`` (positions
read on the host)."""


@chunk_attention_op.register_fake
def _chunk_shapes(q, k, v, *statics):
    return _attention_shapes(q, v)


def _attention_shapes(q: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """out like q with v's head size, lse [b, h, t] in q's accumulator dtype."""
    b, t, h, _ = q.shape
    return (q.new_empty((b, t, h, v.shape[-1])),
            q.new_empty((b, h, t), dtype=accumulator_dtype(q)))


def _positions(positions: Positions, like: torch.Tensor) -> torch.Tensor:
    """int64 positions on ``like``'s device (a tensor passes as it is: the
    core checks its dtype and shape on every rank)."""
    if isinstance(positions, torch.Tensor):
        return positions
    return torch.as_tensor(np.asarray(positions, np.int64), device=like.device)


def _run(entry: str, options: AttentionOptions, q, k, v, comm, q_positions: Positions,
         k_positions: Positions, sinks: Optional[torch.Tensor]):
    """(out, lse) of decode or chunk attention (``entry``): its op, or the
    core where the op cannot carry the options or the sinks (the core
    refuses them on every rank) or where the tensors run directly."""
    core, op = {"decode": (decode_attention_with, decode_attention_op),
                "chunk": (chunk_attention_with, chunk_attention_op)}[entry]
    values = options.graph_values()
    if values is None or not (sinks is None or isinstance(sinks, torch.Tensor)):
        return core(options, q, k, v, comm, q_positions=q_positions, k_positions=k_positions,
                    sinks=sinks)
    if entry == "decode" and runs_directly(q, k, v, sinks):  # the op's body, without dispatch
        return core(options, q, k, v, comm, q_positions=_positions(q_positions, q),
                    k_positions=_positions(k_positions, q), sinks=sinks)
    return op(q, k, v, sinks, _positions(q_positions, q), _positions(k_positions, q),
              comm.handle, *values)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *,
                     q_positions: Positions, k_positions: Positions, causal: bool,
                     window: Any = None, softmax_scale: Optional[float] = None,
                     kernel: Optional[Kernel] = None, return_lse: bool = False,
                     sinks: Optional[torch.Tensor] = None,
                     softcap: Optional[float] = None) -> Any:
    """``commlib.inference.decode_attention`` as one graph node: q [b, t,
    h, d] the same on every rank at ``q_positions`` [t]; k, v [b, n, hk, d]
    this rank's shard at ``k_positions`` [n] (any order; -1: an empty
    slot); ``sinks`` [h] and ``softcap`` as the core's. Positions as int64
    tensors on q's device keep a compiled step from retracing as they change
    (a list is copied there each call). Reads nothing back from the device:
    a CUDA graph can capture it."""
    options = AttentionOptions(causal=causal, window=window, softmax_scale=softmax_scale,
                               softcap=softcap, kernel=kernel)
    out, lse = _run("decode", options, q, k, v, comm, q_positions, k_positions, sinks)
    return (out, lse) if return_lse else out


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *,
                    q_positions: Positions, k_positions: Positions, causal: bool,
                    window: Any = None, softmax_scale: Optional[float] = None,
                    kernel: Optional[Kernel] = None, method: str = "auto",
                    return_lse: bool = False, sinks: Optional[torch.Tensor] = None,
                    softcap: Optional[float] = None) -> Any:
    """``commlib.inference.chunk_attention`` as one graph node (this rank's
    queries of a chunk, increasing positions, over the sharded cache;
    ``method`` "pass_q", "pass_kv" or "auto"; ``sinks`` and ``softcap`` as
    the core's). It reads the positions on the host: compiled, not
    captured."""
    options = AttentionOptions(causal=causal, window=window, softmax_scale=softmax_scale,
                               softcap=softcap, kernel=kernel, method=method)
    out, lse = _run("chunk", options, q, k, v, comm, q_positions, k_positions, sinks)
    return (out, lse) if return_lse else out


class DecodeCache:
    """This rank's shard of a KV cache in buffers of a fixed ``capacity``
    of tokens per layer, whose positions (-1: empty) and count live on the
    device: a decode step over it changes no shape and reads nothing back,
    so it compiles once and a CUDA graph can capture it.

    A step: ``advance(positions)`` (the step's new tokens, the same on
    every rank: this rank keeps those at ``position % size == rank``, as
    ``ShardedKVCache`` stripes them), then per layer ``store(layer, k, v)``
    and ``attend(layer, q, ...)``. Buffers [batch, capacity + 1, kv_heads,
    head_dim]: the extra slot takes the rows this rank does not keep
    (position -1, never seen). More tokens than ``capacity`` cannot raise
    without a device read: they are not kept, this rank's partials turn
    NaN (``overflowed``), and so does every later output of ``attend`` on
    every rank; ``into`` then raises on every rank."""

    def __init__(self, comm, num_layers: int, capacity: int, *, batch: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: Any = "cpu"):
        if num_layers < 1 or capacity < 1:
            raise ValueError(f"a DecodeCache needs at least one layer and one token of "
                             f"capacity, got {num_layers} layers, capacity {capacity}")
        self.comm, self.num_layers, self.capacity = comm, num_layers, capacity
        shape = (batch, capacity + 1, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self.positions = torch.full((capacity + 1,), -1, dtype=torch.int64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.overflowed = torch.zeros((), dtype=torch.bool, device=device)
        self.slots = torch.full((1,), capacity, dtype=torch.int64, device=device)

    @classmethod
    def from_sharded(cls, cache: "_inference.ShardedKVCache", comm, capacity: int, *,
                     like: torch.Tensor) -> "DecodeCache":
        """A DecodeCache holding ``cache``'s tokens (its every layer filled),
        room for ``capacity`` in all; ``like`` [b, ?, kv_heads, head_dim]
        gives the layout, dtype and device."""
        b, _, hk, d = like.shape
        made = cls(comm, cache.num_layers, capacity, batch=b, kv_heads=hk, head_dim=d,
                   dtype=like.dtype, device=like.device)
        held = cache.tokens
        if held > capacity:
            raise ValueError(f"the cache holds {held} tokens on this rank, more than the "
                             f"capacity {capacity}")
        for layer in range(cache.num_layers):
            made.keys[layer][:, :held] = cache.keys(layer, like=like)
            made.values[layer][:, :held] = cache.values(layer, like=like)
        made.positions[:held] = torch.as_tensor(cache.positions, device=like.device)
        made.count.fill_(held)
        return made

    def reset(self) -> None:
        """Empty, in place (the buffers keep their addresses: a captured
        step replays over the emptied cache)."""
        self.positions.fill_(-1)
        self.count.zero_()
        self.overflowed.zero_()

    def advance(self, positions: torch.Tensor) -> None:
        """The step's new tokens at ``positions`` [t] (int64, on the
        device, the same on every rank): where this rank keeps each."""
        keep = positions % self.comm.size == self.comm.rank
        order = self.count + torch.cumsum(keep.to(torch.int64), 0) - 1
        fits = order < self.capacity
        self.slots = torch.where(keep & fits, order, self.capacity)
        self.positions.index_copy_(0, self.slots, torch.where(keep & fits, positions, -1))
        self.overflowed |= (keep & ~fits).any()
        self.count += (keep & fits).sum()

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep this step's ``k``, ``v`` [b, t, kv_heads, d] of ``layer``."""
        self.keys[layer].index_copy_(1, self.slots, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(1, self.slots, v.to(self.values[layer].dtype))

    def attend(self, layer: int, q: torch.Tensor, q_positions: torch.Tensor, *, causal: bool,
               window: Any = None, softmax_scale: Optional[float] = None,
               kernel: Optional[Kernel] = None,
               sinks: Optional[torch.Tensor] = None,
               softcap: Optional[float] = None) -> torch.Tensor:
        """``decode_attention`` of q [b, t, h, d] over ``layer``'s shard."""
        q = torch.where(self.overflowed, torch.nan, q)  # NaN on every rank, not wrong data
        return decode_attention(q, self.keys[layer], self.values[layer], self.comm,
                                q_positions=q_positions, k_positions=self.positions,
                                causal=causal, window=window, softmax_scale=softmax_scale,
                                kernel=kernel, sinks=sinks, softcap=softcap)

    def into(self, cache: "_inference.ShardedKVCache", length: int) -> None:
        """Append the tokens decoded here (past ``cache``'s) to ``cache``,
        which then holds ``length`` tokens over all ranks (host reads: after
        the decode loop, never inside a step)."""
        self.comm.agree("DecodeCache.into", problem=ValueError(
            f"the DecodeCache overflowed its capacity of {self.capacity} tokens on rank "
            f"{self.comm.rank}: every output since was NaN") if bool(self.overflowed) else None)
        held, count = cache.tokens, int(self.count)
        positions = self.positions[held:count].cpu().numpy()
        cache.admit(positions, np.arange(positions.size), length)
        for layer in range(self.num_layers):
            cache.store(layer, self.keys[layer][:, held:count], self.values[layer][:, held:count])
