"""Inference over a sharded KV cache as ``torch.library`` custom ops
(``commlib::decode_attention``, ``commlib::chunk_attention``), and
``DecodeCache``: a rank's shard in fixed buffers, for a decode step that
``torch.compile(fullgraph=True)`` traces without a break and without a
retrace as the cache grows, and that a CUDA graph can capture.

As in ``bindings.torch._attention_ops``, an op takes its communicator and kernel by
name (``commlib.graph_names``) and its positions as int64 tensors; its body is
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

from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from commlib import graph_names
from commlib import inference as _inference
from commlib.kernels import Kernel
from commlib.namespace import accumulator_dtype

from ._attention_ops import op_window
from ._direct import runs_directly

__all__ = ["decode_attention", "chunk_attention", "DecodeCache"]

Positions = Union[torch.Tensor, Sequence[int], np.ndarray]


def _settings(comm: str, window: Optional[List[int]], kernel: Optional[str]) -> dict:
    """The core call's keywords, the named objects looked up."""
    return dict(comm=graph_names.lookup(comm), window=None if window is None else tuple(window),
                kernel=None if kernel is None else graph_names.lookup(kernel))


@torch.library.custom_op("commlib::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        sinks: Optional[torch.Tensor], q_positions: torch.Tensor,
                        k_positions: torch.Tensor, comm: str, causal: bool,
                        window: Optional[List[int]], softmax_scale: Optional[float],
                        kernel: Optional[str]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``commlib.inference.decode_attention`` (device positions)."""
    settings = _settings(comm, window, kernel)
    out, lse = _inference.decode_attention(
        q, k, v, settings.pop("comm"), q_positions=q_positions, k_positions=k_positions,
        causal=causal, softmax_scale=softmax_scale, return_lse=True, sinks=sinks, **settings)
    return out.contiguous(), lse.contiguous()


@decode_attention_op.register_fake
def _decode_shapes(q, k, v, sinks, q_positions, k_positions, comm, causal, window, softmax_scale,
                   kernel):
    return _attention_shapes(q)


@torch.library.custom_op("commlib::chunk_attention", mutates_args=())
def chunk_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       sinks: Optional[torch.Tensor], q_positions: torch.Tensor,
                       k_positions: torch.Tensor, comm: str, causal: bool,
                       window: Optional[List[int]], softmax_scale: Optional[float],
                       kernel: Optional[str], method: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ``commlib.inference.chunk_attention`` (positions read
    on the host)."""
    settings = _settings(comm, window, kernel)
    out, lse = _inference.chunk_attention(
        q, k, v, settings.pop("comm"), q_positions=q_positions.cpu().numpy(),
        k_positions=k_positions.cpu().numpy(), causal=causal, softmax_scale=softmax_scale,
        method=method, return_lse=True, sinks=sinks, **settings)
    return out.contiguous(), lse.contiguous()


@chunk_attention_op.register_fake
def _chunk_shapes(q, k, v, sinks, q_positions, k_positions, comm, causal, window, softmax_scale,
                  kernel, method):
    return _attention_shapes(q)


def _attention_shapes(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """out like q, lse [b, h, t] in q's accumulator dtype."""
    b, t, h, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, t), dtype=accumulator_dtype(q))


def _positions(positions: Positions, like: torch.Tensor) -> torch.Tensor:
    """int64 positions on ``like``'s device (a tensor passes as it is: the
    core checks its dtype and shape on every rank)."""
    if isinstance(positions, torch.Tensor):
        return positions
    return torch.as_tensor(np.asarray(positions, np.int64), device=like.device)


def _fits_an_op(window: Any, sinks: Any) -> bool:
    """Whether the op can carry these arguments: a (left, right) window (or
    None) and sinks that are a tensor (or None); the core refuses the rest
    on every rank."""
    return op_window(window) is not False and (sinks is None or isinstance(sinks, torch.Tensor))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *,
                     q_positions: Positions, k_positions: Positions, causal: bool,
                     window: Any = None, softmax_scale: Optional[float] = None,
                     kernel: Optional[Kernel] = None, return_lse: bool = False,
                     sinks: Optional[torch.Tensor] = None) -> Any:
    """``commlib.inference.decode_attention`` as one graph node: q [b, t,
    h, d] the same on every rank at ``q_positions`` [t]; k, v [b, n, hk, d]
    this rank's shard at ``k_positions`` [n] (any order; -1: an empty
    slot); ``sinks`` [h] as the core's. Positions as int64 tensors on q's
    device keep a compiled step from retracing as they change (a list is
    copied there each call). Reads nothing back from the device: a CUDA
    graph can capture it."""
    if not _fits_an_op(window, sinks):  # the core refuses it on every rank
        return _inference.decode_attention(q, k, v, comm, q_positions=q_positions,
                                           k_positions=k_positions, causal=causal,
                                           window=window, softmax_scale=softmax_scale,
                                           kernel=kernel, return_lse=return_lse, sinks=sinks)
    if runs_directly(q, k, v, sinks):  # the op's body, without its dispatch
        return _inference.decode_attention(q, k, v, comm, q_positions=_positions(q_positions, q),
                                           k_positions=_positions(k_positions, q), causal=causal,
                                           window=window, softmax_scale=softmax_scale,
                                           kernel=kernel, return_lse=return_lse, sinks=sinks)
    out, lse = decode_attention_op(q, k, v, sinks, _positions(q_positions, q),
                                   _positions(k_positions, q), comm.handle, causal,
                                   op_window(window), softmax_scale,
                                   None if kernel is None else kernel.handle)
    return (out, lse) if return_lse else out


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *,
                    q_positions: Positions, k_positions: Positions, causal: bool,
                    window: Any = None, softmax_scale: Optional[float] = None,
                    kernel: Optional[Kernel] = None, method: str = "auto",
                    return_lse: bool = False, sinks: Optional[torch.Tensor] = None) -> Any:
    """``commlib.inference.chunk_attention`` as one graph node (this rank's
    queries of a chunk, increasing positions, over the sharded cache;
    ``method`` "pass_q", "pass_kv" or "auto"; ``sinks`` as the core's). It
    reads the positions on the host: compiled, not captured."""
    if not _fits_an_op(window, sinks):
        return _inference.chunk_attention(q, k, v, comm, q_positions=q_positions,
                                          k_positions=k_positions, causal=causal,
                                          window=window, softmax_scale=softmax_scale,
                                          kernel=kernel, method=method, return_lse=return_lse,
                                          sinks=sinks)
    out, lse = chunk_attention_op(q, k, v, sinks, _positions(q_positions, q),
                                  _positions(k_positions, q), comm.handle, causal,
                                  op_window(window),
                                  softmax_scale, None if kernel is None else kernel.handle,
                                  method)
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
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``decode_attention`` of q [b, t, h, d] over ``layer``'s shard."""
        q = torch.where(self.overflowed, torch.nan, q)  # NaN on every rank, not wrong data
        return decode_attention(q, self.keys[layer], self.values[layer], self.comm,
                                q_positions=q_positions, k_positions=self.positions,
                                causal=causal, window=window, softmax_scale=softmax_scale,
                                kernel=kernel, sinks=sinks)

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
