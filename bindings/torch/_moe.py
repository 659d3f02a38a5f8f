"""PyTorch MoE dispatch/combine over ``commlib.moe``, differentiable: the
backward runs the mirror communication (combine's path for dispatch's
gradient and back). Re-exported by ``bindings.torch``.

``dispatch`` and ``combine`` are ``torch.library`` custom ops
(``commlib::moe_dispatch``, ``commlib::moe_combine`` and their backwards),
so ``torch.compile`` traces them as one node each: the Dispatcher arrives
as its name (``commlib.graph_names``), and the routing state between dispatch
and combine (the core's ``DispatchHandle``: index arrays, hop plans) as a
key tensor the dispatch op returns. The core handle is kept in a table
under that key for as long as the key tensor's storage lives: combine, the
saved tensors of both backwards, or a compiled graph's intermediates hold
it; when the last goes, so does the handle. The key is made when the op
runs, never traced into a graph, so a replayed graph makes a fresh one per
call, and a backward finds the handle of its own forward, however many
micro-batches are in flight. (Rebuilding the handle from tensors instead
would freeze the core's private layout into the op's schema.)

Under a fixed capacity (``max_tokens_per_rank``) the shapes are known
before anything moves, so the fake gives them and a compiled graph has no
break. The counted dispatch's rows depend on the routing (read on the
host): it runs eagerly, one graph break per dispatch, unless
``torch._dynamo.config.capture_dynamic_output_shape_ops`` is set, when the
op is traced with its rows an unbacked size; its combine and both
backwards are ops either way. ``dispatch_async``/``combine_async`` and FP8
(values, scales) stay eager.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from commlib import graph_names
from commlib import moe as _moe

from ._direct import runs_directly

__all__ = ["Dispatcher", "TorchHandle"]

_held: Dict[int, _moe.DispatchHandle] = {}
_serial = itertools.count(1)


class _Slot(bytearray):
    """The key tensor's memory: freed with its storage, which drops the
    handle kept under it (a bytearray subclass, so it can be watched)."""


def _keep(handle: _moe.DispatchHandle) -> torch.Tensor:
    """A fresh int64 key tensor (CPU, 0-d) naming ``handle`` until the
    tensor's storage is freed (views and detached copies share it)."""
    number = next(_serial)
    slot = _Slot(number.to_bytes(8, sys.byteorder, signed=True))
    _held[number] = handle
    weakref.finalize(slot, _held.pop, number, None)
    return torch.frombuffer(slot, dtype=torch.int64).reshape(())


def _core_handle(key: torch.Tensor) -> _moe.DispatchHandle:
    try:
        return _held[int(key)]
    except KeyError:
        raise LookupError(f"commlib: no MoE dispatch handle under key {int(key)}: pass "
                          f"combine the handle its dispatch returned") from None


@torch.library.custom_op("commlib::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 dispatcher: str, quantize: Optional[str]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert_x, tokens_per_expert, key) of the named core Dispatcher's
    dispatch (FP8 rows dequantized)."""
    core = graph_names.lookup(dispatcher)
    expert_x, handle = core.dispatch(x, experts, weights, quantize=quantize,
                                     dequantize=quantize is not None)
    counts = handle.tokens_per_expert
    # host counts are copied (the handle keeps them); a fixed capacity's are fresh already
    counts = counts if isinstance(counts, torch.Tensor) else torch.as_tensor(counts).clone()
    return expert_x.contiguous(), counts, _keep(handle)


@moe_dispatch.register_fake
def _moe_dispatch_shapes(x, experts, weights, dispatcher, quantize):
    core = graph_names.lookup(dispatcher)
    # expert_x of the path this dispatch takes (FP8 rows are dequantized: x's dtype)
    shape: Optional[Tuple[Any, ...]] = core.expert_shape(x, experts.shape[1], quantize)
    if shape is None:  # counted: rows known when it runs
        shape = (torch.library.get_ctx().new_dynamic_size(),) + tuple(x.shape[1:])
        counts = torch.empty(core.local_experts, dtype=torch.int64)
    else:
        counts = torch.empty(core.local_experts, dtype=torch.int64, device=x.device)
    return x.new_empty(shape), counts, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("commlib::moe_dispatch_backward", mutates_args=())
def moe_dispatch_backward(grad: torch.Tensor, key: torch.Tensor, dispatcher: str,
                          tokens: int) -> torch.Tensor:
    """d x [T, H...] from d expert_x, along the combine path."""
    core = graph_names.lookup(dispatcher)
    return core.dispatch_backward(grad, _core_handle(key)).to(grad.dtype).contiguous()


@moe_dispatch_backward.register_fake
def _moe_dispatch_backward_shape(grad, key, dispatcher, tokens):
    fixed = graph_names.lookup(dispatcher).max_tokens_per_rank is not None
    return grad.new_empty((tokens,) + tuple(grad.shape[2 if fixed else 1:]))


def _save_dispatch(ctx, inputs, output):
    x, _, _, ctx.dispatcher, _ = inputs
    ctx.tokens = x.shape[0]
    ctx.save_for_backward(output[2])


def _dispatch_gradient(ctx, grad, _counts, _key):
    (key,) = ctx.saved_tensors
    dx = moe_dispatch_backward(grad.contiguous(), key, ctx.dispatcher, ctx.tokens)
    return dx, None, None, None, None


moe_dispatch.register_autograd(_dispatch_gradient, setup_context=_save_dispatch)


@torch.library.custom_op("commlib::moe_combine", mutates_args=())
def moe_combine(expert_y: torch.Tensor, weights: torch.Tensor, key: torch.Tensor,
                dispatcher: str) -> torch.Tensor:
    """y [T, H...]: each token's weighted sum of its expert rows (the
    weights are the dispatch's; this ``weights`` is what d w reaches)."""
    core = graph_names.lookup(dispatcher)
    return core.combine(expert_y, _core_handle(key)).contiguous()


@moe_combine.register_fake
def _moe_combine_shape(expert_y, weights, key, dispatcher):
    fixed = graph_names.lookup(dispatcher).max_tokens_per_rank is not None
    return expert_y.new_empty((weights.shape[0],) + tuple(expert_y.shape[2 if fixed else 1:]))


@torch.library.custom_op("commlib::moe_combine_backward", mutates_args=())
def moe_combine_backward(expert_y: torch.Tensor, grad: torch.Tensor, key: torch.Tensor,
                         dispatcher: str, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d expert_y, d weights [T, k] float32) from d y."""
    core = graph_names.lookup(dispatcher)
    d_expert_y, d_weights = core.combine_backward(expert_y, grad, _core_handle(key), k)
    return d_expert_y.contiguous(), d_weights.to(torch.float32).contiguous()


@moe_combine_backward.register_fake
def _moe_combine_backward_shapes(expert_y, grad, key, dispatcher, k):
    return (expert_y.new_empty(expert_y.shape),
            grad.new_empty((grad.shape[0], k), dtype=torch.float32))


def _save_combine(ctx, inputs, output):
    expert_y, weights, key, ctx.dispatcher = inputs
    ctx.weights_dtype, ctx.k = weights.dtype, weights.shape[1]
    ctx.save_for_backward(expert_y, key)


def _combine_gradients(ctx, grad):
    expert_y, key = ctx.saved_tensors
    d_expert_y, d_weights = moe_combine_backward(expert_y, grad.contiguous(), key,
                                                 ctx.dispatcher, ctx.k)
    return d_expert_y, d_weights.to(ctx.weights_dtype), None, None


moe_combine.register_autograd(_combine_gradients, setup_context=_save_combine)


@dataclass
class TorchHandle:
    """A dispatch's handle: the key naming the core's handle (or, for a
    dispatch the core ran directly, the core's handle itself, its key made
    if an op asks), the weights tensor combine differentiates, and the rows
    per local expert as the dispatch returned them."""

    key: Optional[torch.Tensor]
    weights: torch.Tensor
    counts: Any
    direct: Optional[_moe.DispatchHandle] = None

    @property
    def core(self) -> _moe.DispatchHandle:
        return self.direct if self.direct is not None else _core_handle(self.key)

    def op_key(self) -> torch.Tensor:
        """The key tensor the ops take."""
        if self.key is None:
            self.key = _keep(self.direct)
        return self.key

    @property
    def tokens_per_expert(self) -> Any:
        """The core's (host int64 counted, a device tensor under a fixed
        capacity); inside a compiled graph, the op's tensor."""
        if torch.compiler.is_compiling():
            return self.counts
        return self.core.tokens_per_expert

    @property
    def stats(self) -> Optional[_moe.DispatchStats]:
        return self.core.stats


class _Dispatch(torch.autograd.Function):
    """An async dispatch's expert_x (eager): the started dispatch's result;
    dx = the expert rows' gradients summed back to their tokens along the
    combine path (straight through a quantization)."""

    @staticmethod
    def forward(ctx, x, weights, core, pending, box):
        expert_x, handle = pending.wait()
        box.append(handle)
        ctx.core, ctx.handle = core, handle
        return expert_x

    @staticmethod
    def backward(ctx, grad):
        return ctx.core.dispatch_backward(grad, ctx.handle), None, None, None, None


class _Combine(torch.autograd.Function):
    """An async combine's y (eager). Backward: dy travels the dispatch path
    to the expert rows; d expert_y = w * dy there; d w = <dy, expert_y>
    per slot, sent back to its token."""

    @staticmethod
    def forward(ctx, expert_y, weights, core, handle, pending):
        ctx.save_for_backward(expert_y, weights)
        ctx.core, ctx.handle = core, handle
        return pending.wait()

    @staticmethod
    def backward(ctx, grad):
        expert_y, weights = ctx.saved_tensors
        d_expert_y, d_weights = ctx.core.combine_backward(expert_y.detach(), grad, ctx.handle,
                                                          weights.shape[1])
        return d_expert_y, d_weights.to(weights.dtype), None, None, None


class _Started:
    """A dispatch or combine in flight whose ``wait()`` records the autograd
    node: the transfer overlaps whatever runs before the wait."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> Any:
        return self._finish()


@torch._dynamo.disable
def _counted_dispatch(x, experts, weights, name, quantize):
    """The counted dispatch, eager: its rows are known only once the
    routing's counts are on the host, so a compiled step breaks here, once
    (with ``capture_dynamic_output_shape_ops`` the op is traced instead,
    its rows an unbacked size)."""
    return moe_dispatch(x, experts, weights, name, quantize)


class Dispatcher:
    """``commlib.moe.Dispatcher`` whose dispatch and combine are
    differentiable in x, weights and expert_y; the same options, refusals
    and handles (``commlib.moe.MoEHandle``). With ``quantize="fp8"`` the
    rows are differentiable when ``dequantize=True`` (the quantization is
    passed straight through, the gradient travels back in its own dtype);
    the (values, scales) pair is not. ``pipeline_chunks`` is the core's:
    reading or setting it here reads or sets the core's. ``placement``: the
    core's (logical router ids, ``expert_x`` grouped by this rank's slots). ``handle`` names
    the core for the ops."""

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None,
                 placement: Optional[_moe.Placement] = None):
        self.core = _moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                                    drop_policy=drop_policy, hierarchical=hierarchical,
                                    max_tokens_per_rank=max_tokens_per_rank,
                                    pipeline_chunks=pipeline_chunks, placement=placement)
        self.handle = graph_names.name("dispatcher", self.core)

    @property
    def pipeline_chunks(self) -> Optional[int]:
        return self.core.pipeline_chunks

    @pipeline_chunks.setter
    def pipeline_chunks(self, chunks: Optional[int]) -> None:
        self.core.pipeline_chunks = chunks  # checked and agreed on by the next dispatch

    @property
    def stats(self) -> _moe.DispatchStats:
        return self.core.stats

    def collect_stats(self) -> _moe.DispatchStats:
        return self.core.collect_stats()

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                 quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, TorchHandle]:
        """The ops' dispatch (compiled whole under a fixed capacity); FP8
        (values, scales) and bad options take the eager path."""
        if quantize is not None and (not dequantize or not isinstance(quantize, str)):
            return self.dispatch_async(x, experts, weights, quantize=quantize,
                                       dequantize=dequantize).wait()
        if runs_directly(x, weights):  # the op's body, without its dispatch
            expert_x, handle = self.core.dispatch(x, experts, weights, quantize=quantize,
                                                  dequantize=dequantize)
            return expert_x, TorchHandle(None, weights, handle.tokens_per_expert, handle)
        run = moe_dispatch if self.core.max_tokens_per_rank is not None \
            or not torch.compiler.is_compiling() \
            or torch._dynamo.config.capture_dynamic_output_shape_ops else _counted_dispatch
        expert_x, counts, key = run(x, experts, weights, self.handle, quantize)
        return expert_x, TorchHandle(key, weights, counts)

    def dispatch_async(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
                       quantize: Optional[str] = None, dequantize: bool = False) -> _Started:
        pending = self.core.dispatch_async(x.detach(), experts, weights.detach(),
                                           quantize=quantize, dequantize=dequantize)
        if quantize is not None and not dequantize:
            def finish():
                values_scales, handle = pending.wait()
                return values_scales, TorchHandle(_keep(handle), weights,
                                                  handle.tokens_per_expert)
            return _Started(finish)

        def finish():
            box: list = []
            expert_x = _Dispatch.apply(x, weights, self.core, pending, box)
            return expert_x, TorchHandle(_keep(box[0]), weights, box[0].tokens_per_expert)
        return _Started(finish)

    def combine(self, expert_y: torch.Tensor, handle: TorchHandle) -> torch.Tensor:
        if runs_directly(expert_y, handle.weights):
            return self.core.combine(expert_y, handle.core)
        return moe_combine(expert_y, handle.weights, handle.op_key(), self.handle)

    def combine_async(self, expert_y: torch.Tensor, handle: TorchHandle) -> _Started:
        core = handle.core
        pending = self.core.combine_async(expert_y.detach(), core)
        return _Started(lambda: _Combine.apply(expert_y, handle.weights, self.core, core,
                                               pending))
