"""Context parallelism for the recurrent layers of transformers' hybrid
models: ``recurrent_parallel(model, comm)`` makes every Gated DeltaNet
(Qwen3-Next) and Mamba2 mixer (Bamba, Granite-MoE-Hybrid, Falcon-H1) run on
this rank's shard of the sequence, in the layout of the model's commlib
attention, in place.

Each mixer's forward is replaced by one that computes what transformers'
training forward computes (5.17 on: the projections, the short causal
convolution, the scan, the gated norm and the output projection, all from
the module's own parameters and submodules), except that

- the depthwise causal convolution (kernel k) reads the k-1 tokens before
  each piece of the shard through ``halo`` (differentiable), and restarts at
  every packed document's start;
- the scan is ``gated_delta_rule`` / ``mamba2_scan`` of
  ``commlib.bindings.torch``: the state entering each piece comes from the
  ranks before it, and resets at document starts.

Documents arrive as the global ``cu_seq_lens_q`` that ``shard_batch`` puts
in the batch and the decoder layers forward to their mixer. A cache passed
by the model is refused, and the model's ``config.use_cache`` is turned off
so that a plain forward makes none. Inside commlib's ``generate``
(``transformers_recurrent_generation``), the sharded prefill also leaves the
global prompt's final state and conv state in generate's cache, on every
rank, and tokens every rank runs alike (decode) go through the module's own
forward (its class's, unpatched) on that cache. A model whose recurrent
layers were not made parallel must not see a sharded batch (each rank
would start its recurrences from a zero state):
``shard_batch(..., attn_implementation=model)`` refuses it
(``unparallel_recurrent_layers``).
"""

from __future__ import annotations

import copy
import functools
import reprlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from commlib.documents import as_offsets
from commlib.recurrent.pieces import sharding

from .recurrent_marks import mark_parallel
from .torch import gated_delta_rule, mamba2_scan
from .torch_recurrent_state import halo
from .transformers_attention import layout_of
from .transformers_recurrent_generation import keep_states, prefill, replicated_states

__all__ = ["recurrent_parallel", "unparallel_recurrent_layers", "unparallel_refusal",
           "has_parallel_recurrent_layers", "FAMILIES"]

_SHARDED = "_commlib_recurrent_parallel"  # on mixers made parallel: their _Sharded


@dataclass(frozen=True)
class _Sharded:
    """What a parallel mixer's forward needs besides the module: the
    communicator and the model's config (whose attention names the layout)."""

    comm: Any
    config: Any

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Sharded":
        """A copied model's mixers share the communicator, and its config is
        marked parallel like the original's."""
        config = copy.deepcopy(self.config, memo)
        mark_parallel(config)
        return _Sharded(self.comm, config)


def _is_recurrent(module: nn.Module) -> bool:
    """A recurrent mixer of any family transformers has (Mamba, Mamba2, Gated
    DeltaNet...): a decay ``A_log`` and a short convolution ``conv1d``."""
    return isinstance(module._parameters.get("A_log"), torch.Tensor) and \
        isinstance(getattr(module, "conv1d", None), nn.Conv1d)


def unparallel_recurrent_layers(model: nn.Module) -> List[str]:
    """The names of ``model``'s recurrent mixers that ``recurrent_parallel``
    has not made parallel (empty: none, or every one is)."""
    return [name for name, module in model.named_modules()
            if _is_recurrent(module) and not hasattr(module, _SHARDED)]


def unparallel_refusal(model: nn.Module, before: str) -> Optional[ValueError]:
    """The error for a model whose recurrent mixers were not all made
    parallel, to be raised before ``before`` shards it (None: nothing to
    refuse)."""
    unparallel = unparallel_recurrent_layers(model)
    if not unparallel:
        return None
    return ValueError(f"{type(model).__name__}'s recurrent layers {reprlib.repr(unparallel)} "
                      f"are not context-parallel: on a shard each would start from a zero "
                      f"state; call recurrent_parallel(model, comm) before {before}")


def has_parallel_recurrent_layers(model: nn.Module) -> bool:
    """Whether ``recurrent_parallel`` made some mixer of ``model`` parallel."""
    return any(hasattr(module, _SHARDED) for module in model.modules())


# ---- the causal convolution ----------------------------------------------------------------

def _documents(kwargs: Dict[str, Any]) -> Optional[List[int]]:
    """The packed documents' global offsets the layer was given (None: one
    unpadded sequence), as host ints."""
    given = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seq_lens_k"))
    return None if given is None else [int(offset) for offset in as_offsets(
        given.cpu() if isinstance(given, torch.Tensor) else given)]


def _causal_conv(conv: nn.Conv1d, activation: str, x: torch.Tensor, comm, layout: str,
                 cu_seqlens: Optional[List[int]]) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, causal, then the
    activation) on the shard x [b, l, channels]: each piece reads the
    ``kernel - 1`` tokens before it from its halo, and each document inside a
    piece starts from zeros, as at the sequence's start."""
    width = conv.kernel_size[0] - 1
    before = halo(x, width, comm, layout=layout, axis=1, cu_seqlens=cu_seqlens)
    starts = () if cu_seqlens is None else cu_seqlens[1:-1]
    outs = []
    for piece, tokens_before in zip(sharding(comm, x.shape[1], layout=layout,
                                             cu_seqlens=cu_seqlens).per_rank[comm.rank], before):
        inside = [] if piece.is_padding else [
            start - piece.origin + piece.start for start in starts
            if piece.origin < start < piece.origin + piece.length]
        cuts = [piece.start, *inside, piece.stop]
        for i, (first, stop) in enumerate(zip(cuts, cuts[1:])):
            prefix = tokens_before if i == 0 else torch.zeros_like(tokens_before)
            window = torch.cat([prefix, x[:, first:stop]], dim=1).transpose(1, 2)
            outs.append(F.conv1d(window.to(conv.weight.dtype), conv.weight, conv.bias,
                                 groups=conv.groups))
    return ACT2FN[activation](torch.cat(outs, dim=2)).to(x.dtype).transpose(1, 2)


# ---- the forwards --------------------------------------------------------------------------

def _own_forward_when_replicated(sharded_forward: Callable[..., torch.Tensor]
                                 ) -> Callable[..., torch.Tensor]:
    """``sharded_forward``, except on tokens every rank runs alike inside
    generate (decode): there the module's own forward, on generate's cache."""

    @functools.wraps(sharded_forward)
    def forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: Optional[torch.Tensor] = None, cache_params: Any = None,
                **kwargs: Any) -> torch.Tensor:
        states = replicated_states()
        if states is None or cache is not None or cache_params is not None:
            return sharded_forward(self, hidden_states, cache, attention_mask, cache_params,
                                   **kwargs)
        return type(self).forward(self, hidden_states, states, attention_mask, **kwargs)
    return forward


def _checked_call(module: nn.Module, cache: Any,
                  attention_mask: Optional[torch.Tensor], kwargs: Dict[str, Any]
                  ) -> Tuple[_Sharded, str, Optional[List[int]], Any]:
    """Refuse what the sharded forward does not compute (every check reads
    what every rank has alike), then its communicator, layout, documents and,
    inside generate's prefill, the cache to leave its states in (else None)."""
    kind = type(module).__name__
    if cache is not None:
        raise ValueError(f"{kind} was made context-parallel by recurrent_parallel, which runs "
                         f"the training / prefill forward only: call the model with "
                         f"use_cache=False (to generate, use "
                         f"commlib.bindings.transformers.generate)")
    if attention_mask is not None:
        raise ValueError(f"{kind} (recurrent_parallel) got a padding mask; padding masks are "
                         f"not implemented: make the batch with shard_batch (packed documents "
                         f"travel as cu_seq_lens_q)")
    sharded: _Sharded = getattr(module, _SHARDED)
    generating = prefill()
    if generating is not None:
        return sharded, generating[1], _documents(kwargs), generating[0]
    try:
        layout = layout_of(sharded.config._attn_implementation)
    except ValueError as error:
        raise ValueError(f"{kind} (recurrent_parallel) reads the sequence in the layout of the "
                         f"model's commlib attention: {error}") from None
    return sharded, layout, _documents(kwargs), None


@_own_forward_when_replicated
def _gated_delta_net_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                             attention_mask: Optional[torch.Tensor] = None,
                             cache_params: Any = None, **kwargs: Any) -> torch.Tensor:
    """Qwen3-Next's ``Qwen3NextGatedDeltaNet`` forward, without a cache, on
    this rank's shard (inside generate's prefill, its states kept)."""
    sharded, layout, documents, states = _checked_call(
        self, cache if cache is not None else cache_params, attention_mask, kwargs)
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
    mixed = torch.cat([t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value)],
                      dim=-1)
    conv_input = mixed
    mixed = _causal_conv(self.conv1d, self.activation, mixed, sharded.comm, layout, documents)
    query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    batch, length = mixed.shape[:2]
    query = query.reshape(batch, length, -1, self.head_k_dim)
    key = key.reshape(batch, length, -1, self.head_k_dim)
    value = value.reshape(batch, length, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    group = self.num_v_heads // self.num_k_heads
    if group > 1:  # each query/key head serves `group` consecutive value heads
        query, key = query.repeat_interleave(group, dim=2), key.repeat_interleave(group, dim=2)
    out, final = gated_delta_rule(query, key, value, g, beta, sharded.comm, layout=layout,
                                  cu_seqlens=documents, use_qk_l2norm_in_kernel=True,
                                  output_final_state=states is not None)
    if states is not None:
        keep_states(states, self.layer_idx, final, conv_input, self.conv1d.kernel_size[0],
                    sharded.comm, layout, documents)
    out = self.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
    return self.out_proj(out.reshape(batch, length, -1))


@_own_forward_when_replicated
def _mamba2_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                    attention_mask: Optional[torch.Tensor] = None, cache_params: Any = None,
                    **kwargs: Any) -> torch.Tensor:
    """The Mamba2 mixers' torch forward (Bamba's, which Granite-MoE-Hybrid
    copies, and Falcon-H1's, which scales its input and projections and may
    gate without a norm), without a cache, on this rank's shard (inside
    generate's prefill, its states kept)."""
    sharded, layout, documents, states = _checked_call(
        self, cache if cache is not None else cache_params, attention_mask, kwargs)
    dtype = hidden_states.dtype
    falcon = hasattr(self, "mup_vector")
    if falcon:
        projected = self.in_proj(hidden_states * self.ssm_in_multiplier) * self.mup_vector
    else:
        projected = self.in_proj(hidden_states)
    gate, x_b_c, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads],
                                      dim=-1)
    conv_input = x_b_c
    x_b_c = _causal_conv(self.conv1d, self.activation, x_b_c, sharded.comm, layout, documents)
    groups_state = self.n_groups * self.ssm_state_size
    x, B, C = torch.split(x_b_c, [self.intermediate_size, groups_state, groups_state], dim=-1)
    batch, length = x.shape[:2]
    y = mamba2_scan(x.reshape(batch, length, self.num_heads, self.head_dim), dt,
                    -torch.exp(self.A_log.float()),
                    B.reshape(batch, length, self.n_groups, self.ssm_state_size),
                    C.reshape(batch, length, self.n_groups, self.ssm_state_size), sharded.comm,
                    layout=layout, chunk_size=self.chunk_size, D=self.D, dt_bias=self.dt_bias,
                    dt_softplus=True, dt_limit=tuple(self.time_step_limit),
                    cu_seqlens=documents, return_final_states=states is not None)
    if states is not None:
        y, final = y
        keep_states(states, self.layer_idx, final, conv_input, self.conv1d.kernel_size[0],
                    sharded.comm, layout, documents)
    y = y.reshape(batch, length, -1)
    if falcon and not self.mamba_rms_norm:
        y = y * F.silu(gate)
    else:
        y = self.norm(y, gate)
    return self.out_proj(y.to(dtype))


@dataclass(frozen=True)
class Family:
    """A mixer class recurrent_parallel knows: the forward that replaces its
    own, and the attributes that forward reads (checked at patch time, so a
    transformers version that changed the module is refused, not misread)."""

    forward: Callable[..., torch.Tensor]
    attributes: Tuple[str, ...]


_GATED_DELTA_NET = Family(_gated_delta_net_forward, (
    "in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering", "conv1d", "activation",
    "key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads",
    "A_log", "dt_bias", "norm", "out_proj", "layer_idx"))
_MAMBA2 = ("in_proj", "conv1d", "activation", "intermediate_size", "conv_dim", "num_heads",
           "head_dim", "n_groups", "ssm_state_size", "chunk_size", "time_step_limit", "A_log",
           "dt_bias", "D", "norm", "out_proj", "layer_idx")
_BAMBA = Family(_mamba2_forward, _MAMBA2)
_FALCON_H1 = Family(_mamba2_forward, _MAMBA2 + ("ssm_in_multiplier", "mup_vector",
                                                 "mamba_rms_norm"))

# the mixer classes, by name (their modules are imported only with their models)
FAMILIES: Dict[str, Family] = {
    "Qwen3NextGatedDeltaNet": _GATED_DELTA_NET,
    "BambaMixer": _BAMBA,
    "GraniteMoeHybridMambaLayer": _BAMBA,
    "FalconH1Mixer": _FALCON_H1,
}


def _refusal(module: nn.Module) -> Optional[str]:
    """Why this recurrent mixer cannot be made parallel (None: it can)."""
    kind = type(module).__name__
    family = FAMILIES.get(kind)
    if family is None:
        return (f"{kind} is a recurrent mixer that recurrent_parallel does not implement "
                f"(it makes {', '.join(FAMILIES)} context-parallel)")
    if hasattr(module, _SHARDED):
        return f"{kind} is already context-parallel: recurrent_parallel was called twice"
    missing = [name for name in family.attributes if not hasattr(module, name)]
    if missing:
        return (f"{kind} lacks {', '.join(missing)}: this transformers version's module is not "
                f"the one recurrent_parallel computes (checked against transformers 5.17 to "
                f"5.25)")
    conv = module.conv1d
    depthwise = conv.groups == conv.in_channels == conv.out_channels
    if not depthwise or conv.stride != (1,) or conv.dilation != (1,) or conv.kernel_size[0] < 2:
        return (f"{kind}.conv1d is not a depthwise causal convolution of stride 1 and kernel "
                f">= 2 (found {conv})")
    return None


def recurrent_parallel(model: nn.Module, comm) -> nn.Module:
    """Make every recurrent mixer of ``model`` (Gated DeltaNet: Qwen3-Next;
    Mamba2: Bamba, Granite-MoE-Hybrid, Falcon-H1) context-parallel over
    ``comm``, in place (collective): each runs on this rank's shard of the
    sequence, in the layout of the model's commlib attention
    (``config._attn_implementation``, read at every forward), its
    convolution reading the tokens before the shard and its state the state
    before it, both reset at packed documents' starts. Parameters are not
    split (sum their gradients with ``allreduce_gradients``); experts may be
    split too (``expert_parallel``). Turns ``config.use_cache`` off: the
    sharded forward is the training / prefill one, and a cache is refused
    (``commlib.bindings.transformers.generate`` generates with the model).
    A model without recurrent mixers, or with one of a family (or
    transformers version) it does not implement, raises ValueError on every
    rank, unchanged."""
    mixers = [module for module in model.modules() if _is_recurrent(module)]
    refusals = [reason for reason in map(_refusal, mixers) if reason is not None]
    if not mixers:
        refusals.append(f"{type(model).__name__} has no recurrent mixer (a module with A_log "
                        f"and a conv1d)")
    problem = ValueError("; ".join(dict.fromkeys(refusals))) if refusals else None
    comm.agree("transformers.recurrent_parallel", *(type(m).__name__ for m in mixers),
               problem=problem)
    sharded = _Sharded(comm, model.config)
    for module in mixers:
        setattr(module, _SHARDED, sharded)
        module.forward = types.MethodType(FAMILIES[type(module).__name__].forward, module)
    model.config.use_cache = False
    mark_parallel(model.config)
    return model
