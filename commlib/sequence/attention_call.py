"""The facts of an attention call, checked and agreed once: shared by Ring,
Ulysses and the hybrid.

Each rank checks its own shards (arrays of any one framework) and hands any
problem to ``Communicator.agree``, so that all ranks raise together; what
the checks learned (``AttentionCall``) then travels with the call."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Tuple, Union

from ..kernels import Kernel, capped, kernel_for
from ..kernels.sinks import check_sinks, sinks_fact
from ..namespace import dtype_name, framework_of, namespace, on_cuda
from .balanced import Assigned, placement_for
from .documents import Grouped, Packing, Span
from .masks import Mask, check_mask, from_band
from .options import AttentionOptions
from .visibility import blocks, bounds, mask_blocks

Extra = Tuple[Tuple[str, Any, tuple], ...]

ATTENTION_DTYPES = ("float32", "bfloat16", "float16", "float64")
# where each token of the sequence sits: its rank and place (the MoE experts have moe.Placement)
TokenPlacement = Union[Packing, Assigned, Grouped]


def check_qkv(q: Any, k: Any, v: Any, extra: Extra = (), same_length: bool = True) -> None:
    """q [b, s, h, d], k [b, s, hk, d] and v [b, s, hk, dv] with h % hk == 0 (k and v of
    any length where not ``same_length``: a cache), one framework, one
    dtype, one side (host or CUDA), and the ``extra`` (name, array, shape)
    triples."""
    named = (("q", q), ("k", k), ("v", v))
    check_together(named, ("[batch, seq, heads, head_dim]",) * 3)
    (b, s, h, d), (kb, ks, hk, kd) = q.shape, k.shape
    if tuple(v.shape[:3]) != tuple(k.shape[:3]):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on batch, "
                         f"sequence length and kv heads (their head sizes may differ: "
                         f"multi-head latent attention)")
    if (kb, ks if same_length else s, kd) != (b, s, d):
        what = "batch, local sequence length and head_dim" if same_length \
            else "batch and head_dim"
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on {what}")
    if hk == 0 or h % hk:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hk}) for GQA/MQA")
    check_dtype(named, extra)


def _listed(named: Sequence[Tuple[str, Any]]) -> str:
    names = [name for name, _ in named]
    return ", ".join(names[:-1]) + " and " + names[-1]


def check_together(named: Sequence[Tuple[str, Any]], layouts: Sequence[str]) -> None:
    """The (name, array) pairs come from one framework and one side (host
    or CUDA), each with the axes its entry of ``layouts`` names
    ("[batch, seq, heads, head_dim]")."""
    kinds = {name: framework_of(name, x) for name, x in named}
    if len(set(kinds.values())) != 1:
        raise ValueError(f"{_listed(named)} must come from one framework, got "
                         f"{', '.join(f'{n}: {f}' for n, f in kinds.items())}")
    if len({on_cuda(x) for _, x in named}) != 1:
        raise ValueError(f"{_listed(named)} must all be host arrays or all CUDA arrays")
    for (name, x), layout in zip(named, layouts):
        if len(x.shape) != layout.count(",") + 1:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def check_dtype(named: Sequence[Tuple[str, Any]], extra: Extra = ()) -> None:
    """The (name, array) pairs have one dtype that attention takes, and the
    ``extra`` (name, array, shape) triples their shapes."""
    names = [dtype_name(x) for _, x in named]
    if len(set(names)) != 1:
        raise ValueError(f"{_listed(named)} must have one dtype, got {', '.join(names)}")
    if names[0] not in ATTENTION_DTYPES:
        raise ValueError(f"attention takes {_listed(named)} of {', '.join(ATTENTION_DTYPES)}, "
                         f"got {names[0]}; cast them first")
    for name, x, shape in extra:
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")


def backward_extras(q: Any, v: Any, dout: Any, out: Any, lse: Any) -> Extra:
    """What a backward pass checks beyond q, k, v: dout and out shaped like
    q with v's head size, lse [b, h, s]."""
    b, s, h = tuple(q.shape[:3]) if len(q.shape) == 4 else (0, 0, 0)
    shape = (b, s, h, v.shape[-1]) if len(v.shape) == 4 else tuple(q.shape)
    return (("dout", dout, shape), ("out", out, shape), ("lse", lse, (b, h, s)))


def scale_of(q: Any, softmax_scale: Optional[float]) -> float:
    return softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call is, read from its inputs once on this rank and
    agreed by every rank: the arrays' namespace, the block kernel (bound to
    the options' ``softcap``: ``kernels.capped``), the softmax scale, where
    every rank's tokens sit in the documents (``placement``: a
    ``commlib.sequence.documents.Packing``, a
    ``commlib.sequence.balanced.Assigned``, or either ``Grouped`` as the hybrid's
    ring sees it; each has ``offsets``, ``size``, ``spans``, ``in_order``)
    and which query-key
    distances are visible (``lo``, ``hi``). It travels with the call from
    the checks to the schedule and the kernel, so nothing re-reads ``q``."""

    xp: Any
    kernel: Kernel
    scale: float
    placement: TokenPlacement
    lo: int
    hi: int
    mask: Optional[Mask] = None

    def blocks(self, q_spans: Tuple[Span, ...], k_spans: Tuple[Span, ...]):
        """The visible blocks of queries ``q_spans`` against keys ``k_spans``
        (under the call's mask, if it has one)."""
        if self.mask is not None:
            return mask_blocks(self.mask, q_spans, k_spans)
        return blocks(q_spans, k_spans, self.lo, self.hi)

    def visibility(self) -> Mask:
        """The call's mask: the one given, or its documents, causality and
        window as one (``masks.from_band``)."""
        if self.mask is not None:
            return self.mask
        return from_band(tuple(self.placement.offsets), self.lo, self.hi)

    def over_groups(self, group_size: int) -> "AttentionCall":
        """The same call as seen by a ring of groups of ``group_size``
        consecutive ranks, each holding its members' shards one after the
        other (the hybrid, after the Ulysses all-to-all in each group)."""
        return replace(self, placement=Grouped(self.placement, group_size))


def prepare(comm, op: str, q: Any, k: Any, v: Any, options: AttentionOptions, *, layout: str,
            extra: Extra = (), sinks: Any = None, check: Callable[[], None] = lambda: None,
            check_inputs: Optional[Callable[[], None]] = None, **settings: Any) -> AttentionCall:
    """Check the inputs on this rank (q, k, v and ``extra``, or
    ``check_inputs()`` where K and V come in another form, a latent; then
    ``sinks``, the ``options`` and ``check()``, the algorithm's own checks,
    each raising ValueError), agree on them, on the options' facts and on
    every setting with every rank (any problem raises on all), and return
    the call's facts."""
    packing = visible = kernel = None
    problem = None
    mask, causal, cu_seqlens, window = (options.mask, options.causal, options.cu_seqlens,
                                        options.window)
    try:
        check_inputs() if check_inputs is not None else check_qkv(q, k, v, extra)
        check_sinks(sinks, q)
        options.check()
        check()
        if mask is not None:
            check_mask(mask, None)
            if causal or cu_seqlens is not None or window is not None:
                raise ValueError("mask= says which keys every query sees: pass it alone, "
                                 "without causal, cu_seqlens or window (build those into it: "
                                 "commlib.sequence.masks.from_cu_seqlens)")
        packing = placement_for(layout, comm.size, q.shape[1], cu_seqlens=cu_seqlens,
                                mask=mask)
        visible = bounds(causal, window)
        kernel = kernel_of(options, q)
    except ValueError as error:
        problem = error
    scale = None if problem else scale_of(q, options.softmax_scale)
    facts = options.facts(digest=not problem)
    agree_on_inputs(comm, op, q, k, problem, causal=facts.pop("causal"), layout=layout,
                    window=facts.pop("window"), documents=_documents(packing),
                    mask=facts.pop("mask"), scale=scale, sinks=sinks_fact(sinks), **facts,
                    **settings)
    return AttentionCall(namespace(q), kernel, scale, packing, *visible, mask)


def kernel_of(options: AttentionOptions, q: Any) -> Kernel:
    """The call's block kernel: the options' (or the built-in one for q and
    the cap), bound to the cap (a ValueError where it cannot cap)."""
    return capped(options.kernel or kernel_for(q, options.softcap), options.softcap)


def _documents(packing: Optional[TokenPlacement]) -> str:
    """A short digest of the documents, for the cross-rank agreement."""
    if packing is None:
        return "unreadable"
    return f"{len(packing.offsets) - 1} docs/{zlib.crc32(repr(packing.offsets).encode())}"


def agree_on_inputs(comm, op: str, q: Any, k: Any, problem: Optional[Exception],
                    shared_axes: Tuple[int, ...] = (0, 1, 2, 3), **settings: Any) -> None:
    """All ranks must call ``op`` with the same shapes along ``shared_axes``
    (all of them by default, local sequence lengths included), dtype and
    ``settings``, and none may have a ``problem`` with its own inputs;
    otherwise every rank raises ``CollectiveMismatchError``."""
    def shape(x: Any) -> tuple:
        dims = tuple(getattr(x, "shape", ()))
        return tuple(dims[axis] for axis in shared_axes if axis < len(dims))
    described = tuple(f"{name}={value}" for name, value in settings.items())
    comm.agree(op, shape(q), shape(k), _dtype_or_type(q), *described, problem=problem)


def _dtype_or_type(x: Any) -> str:
    try:
        return dtype_name(x)
    except (TypeError, AttributeError):
        return type(x).__name__
