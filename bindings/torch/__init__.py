"""PyTorch functions over commlib: Ring, Ulysses and hybrid attention, the
Ulysses relayouts, MoE dispatch/combine (``_moe.py``), decode and chunk
attention over a sharded KV cache (``_inference.py``), the sharded Gated
DeltaNet and Mamba2 mixers (``_recurrent.py``, over ``_recurrent_state.py``).

Attention and the relayouts are ``torch.library`` custom ops
(``_attention_ops.py``), so ``torch.compile`` traces each call as one node
without a graph break; their backward runs the mirror communication
(ring_attention_backward, head_to_seq for seq_to_head; combine's path for
dispatch's gradient and back). Tensors cross into commlib through
DLPack without a copy (a contiguous CPU tensor shares its memory) and the
results come back as tensors on the caller's device. The computation is
torch's own, in the tensors' dtype (PyTorch's fused SDPA kernels for the
attention blocks), never NumPy.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from commlib import ulysses as _ulysses
from commlib.kernels import Kernel
from commlib.sequence.options import AttentionOptions

from . import _attention_ops as _ops
from . import _wire_ops
from ._direct import runs_directly
from ._inference import DecodeCache, chunk_attention, decode_attention
from ._latent_ops import latent_call
from ._moe import Dispatcher, TorchHandle
from ._overlapped import ulysses_attention_overlapped
from ._recurrent import SummedOverRanks as SummedOverRanks  # shared with the transformers binding
from ._recurrent import gated_delta_rule, mamba2_scan
from ._recurrent_state import halo as halo  # shared with the transformers binding

__all__ = ["ring_attention", "ulysses_attention", "hybrid_attention", "seq_to_head",
           "head_to_seq", "Dispatcher", "TorchHandle", "decode_attention", "chunk_attention",
           "DecodeCache", "gated_delta_rule", "mamba2_scan", "ulysses_attention_overlapped",
           "latent_ring_attention"]


def _attention(q, k, v, comm, algorithm: str, options: AttentionOptions, *, layout: str,
               ulysses_size: int = 0, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``commlib::attention`` op's out (``commlib::attention_wire``'s
    with a ``wire``). Options no graph can carry (a window that is not a
    (left, right) pair of token counts, a cap that is not a number) and
    sinks that are not a tensor go to the core, which refuses them on every
    rank."""
    if options.wire is not None:
        _wire_ops.refuse_gradients(comm, algorithm, options.wire, q, k, v,
                                   *([sinks] if isinstance(sinks, torch.Tensor) else []))
    carried = _ops.graph_arguments(options, sinks)
    if carried is None:
        return _ops.forward(algorithm, options, q, k, v, comm, layout, ulysses_size, sinks,
                            return_lse=False)
    documents, values = carried
    op_args = (q, k, v, sinks, documents, algorithm, comm.handle, layout, ulysses_size, *values)
    if options.wire is not None:
        return _wire_ops.attention_wire(*op_args)
    out, _ = _ops.attention(*op_args)
    return out


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *, layout: str,
                   causal: bool, softmax_scale: Optional[float] = None,
                   cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                   method: str = "auto", kernel: Optional[Kernel] = None,
                   sinks: Optional[torch.Tensor] = None,
                   softcap: Optional[float] = None) -> torch.Tensor:
    """Differentiable ``commlib.ring.ring_attention`` (shards in ``layout``,
    packed ``cu_seqlens``, sliding ``window``, or any ``mask``; ``method``
    as ``ring_attention``'s); ``kernel`` replaces torch's fused SDPA kernels
    (``commlib.kernels.Kernel``); ``sinks`` [h], one logit per query head
    (gpt-oss), gets this rank's queries' share of its gradient (sum it over
    the ranks, as every replicated parameter's: ``allreduce_gradients``);
    ``softcap`` caps the scores (Gemma2: the tiled kernel, in torch)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return _attention(q, k, v, comm, "ring", options, layout=layout, sinks=sinks)


def latent_ring_attention(q: torch.Tensor, latent: torch.Tensor, rope_k: torch.Tensor,
                          w_uk: torch.Tensor, w_uv: torch.Tensor, comm, *, layout: str,
                          causal: bool, softmax_scale: Optional[float] = None,
                          cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                          method: str = "auto", kernel: Optional[Kernel] = None,
                          sinks: Optional[torch.Tensor] = None,
                          softcap: Optional[float] = None) -> torch.Tensor:
    """Differentiable ``commlib.ring.latent_ring_attention`` (multi-head
    latent attention: the latent and the rotary key travel, K and V are
    expanded by ``w_uk`` and ``w_uv`` where they arrive); the weights and
    ``sinks`` get this rank's share of their gradients (sum them over the
    ranks: ``allreduce_gradients``)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method)
    return latent_call(q, latent, rope_k, w_uk, w_uv, comm, options, layout, sinks)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm, *, layout: str,
                      causal: bool, softmax_scale: Optional[float] = None,
                      cu_seqlens: Any = None, window: Any = None, mask: Any = None,
                      kernel: Optional[Kernel] = None,
                      sinks: Optional[torch.Tensor] = None,
                      wire: Optional[str] = None,
                      softcap: Optional[float] = None) -> torch.Tensor:
    """Differentiable ``commlib.ulysses.ulysses_attention`` (``sinks`` and
    ``softcap`` as ``ring_attention``'s); with ``wire="float8"`` forward only
    (refused where q, k or v requires grad)."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               wire=wire)
    return _attention(q, k, v, comm, "ulysses", options, layout=layout, sinks=sinks)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm,
                     ulysses_size: int, *, layout: str, causal: bool,
                     softmax_scale: Optional[float] = None, cu_seqlens: Any = None,
                     window: Any = None, mask: Any = None, method: str = "auto",
                     kernel: Optional[Kernel] = None,
                     sinks: Optional[torch.Tensor] = None,
                     wire: Optional[str] = None,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """Differentiable ``commlib.hybrid.hybrid_attention`` (``sinks`` and
    ``softcap`` as ``ring_attention``'s); with ``wire="float8"`` (its Ulysses
    stage) forward only."""
    options = AttentionOptions(causal=causal, window=window, cu_seqlens=cu_seqlens, mask=mask,
                               softmax_scale=softmax_scale, softcap=softcap, kernel=kernel,
                               method=method, wire=wire)
    return _attention(q, k, v, comm, "hybrid", options, layout=layout,
                      ulysses_size=ulysses_size, sinks=sinks)


def seq_to_head(x: torch.Tensor, comm, num_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s/P, h, d] -> [b, s, h_p, d]; its adjoint is head_to_seq."""
    if runs_directly(x):
        return _ulysses.seq_to_head(x, comm, num_heads)
    return _ops.seq_to_head(x, comm.handle, num_heads)


def head_to_seq(x: torch.Tensor, comm, heads: Optional[int] = None,
                num_heads: Optional[int] = None) -> torch.Tensor:
    """Differentiable [b, s, h_p, d] -> [b, s/P, h, d]; its adjoint is seq_to_head."""
    if runs_directly(x):
        return _ulysses.head_to_seq(x, comm, heads, num_heads)
    return _ops.head_to_seq(x, comm.handle, heads, num_heads)
