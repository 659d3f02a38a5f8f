"""Context parallelism for the recurrent layers of transformers' hybrid
models: ``recurrent_parallel(model, comm)`` makes every Gated DeltaNet
(Qwen3-Next), Mamba2 mixer (Bamba, Granite-MoE-Hybrid, Falcon-H1) and short
convolution (LFM2, LFM2-MoE, LFM3: a gated depthwise causal convolution, no
scan) run on this rank's shard of the sequence, in the layout of the model's
commlib attention, in place.

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
(``_recurrent_generation``), the sharded prefill also leaves the
global prompt's final state and conv state in generate's cache, on every
rank, and tokens every rank runs alike (decode) go through the module's own
forward (its class's, unpatched) on that cache. A model whose recurrent
layers were not made parallel must not see a sharded batch (each rank
would start its recurrences from a zero state):
``shard_batch(..., attn_implementation=model)`` refuses it
(``_model_check``).
"""

from __future__ import annotations

import contextvars
import copy
import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from commlib.recurrent.pieces import sharding
from commlib.sequence.documents import as_offsets

from ..torch import gated_delta_rule, halo, mamba2_scan
from ._attention import LAYOUTS, PositionCheck, layout_of
from ._recurrent_generation import keep_states, prefill, replicated_states
from ._token_mixers import Mixer, probed, probing

__all__ = ["recurrent_parallel", "is_parallel_mixer", "has_parallel_recurrent_layers",
           "FAMILIES"]

_SHARDED = "_commlib_recurrent_parallel"  # on mixers made parallel: their _Sharded


@dataclass(frozen=True)
class _Sharded:
    """What a parallel mixer's forward needs besides the module: the
    communicator and the model's config (whose attention names the layout)."""

    comm: Any
    config: Any

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Sharded":
        """A copied model's mixers share the communicator."""
        return _Sharded(self.comm, copy.deepcopy(self.config, memo))


def is_parallel_mixer(module: nn.Module) -> bool:
    """Whether ``recurrent_parallel`` made this module context-parallel."""
    return hasattr(module, _SHARDED)


def has_parallel_recurrent_layers(model: nn.Module) -> bool:
    """Whether ``recurrent_parallel`` made some mixer of ``model`` parallel."""
    return any(map(is_parallel_mixer, model.modules()))


# ---- the causal convolution ----------------------------------------------------------------

# the documents given to the layer that calls a mixer whose forward takes no
# keyword arguments beyond its own (LFM2's at transformers 5.17), for that mixer
_LAYER_DOCUMENTS: contextvars.ContextVar[Optional[Dict[str, Any]]] = contextvars.ContextVar(
    "commlib_recurrent_layer_documents", default=None)
_DOCUMENT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")


def _keep_layer_documents(layer: nn.Module, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> None:
    """A forward pre-hook of such a mixer's caller: its documents, for the
    mixer to read."""
    _LAYER_DOCUMENTS.set({key: kwargs[key] for key in _DOCUMENT_KEYS if key in kwargs})


def _drop_layer_documents(layer: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                          output: Any) -> None:
    _LAYER_DOCUMENTS.set(None)


def _documents_through_callers(model: nn.Module, mixers: List[nn.Module]) -> None:
    """The mixers whose own forward has no ``**kwargs`` never see the
    documents the decoder layer calling them was given (transformers 5.17's
    LFM2 passes its conv none): a hook on each such caller hands them over."""
    deaf = {id(module) for module in mixers if not any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD
        for parameter in inspect.signature(type(module).forward).parameters.values())}
    for caller in model.modules():
        if any(id(child) in deaf for child in caller.children()):
            caller.register_forward_pre_hook(_keep_layer_documents, with_kwargs=True)
            caller.register_forward_hook(_drop_layer_documents, with_kwargs=True,
                                         always_call=True)


def _documents(kwargs: Dict[str, Any]) -> Optional[List[int]]:
    """The packed documents' global offsets the layer was given (None: one
    unpadded sequence), as host ints."""
    if not any(key in kwargs for key in _DOCUMENT_KEYS):
        kwargs = _LAYER_DOCUMENTS.get() or {}
    given = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seq_lens_k"))
    return None if given is None else [int(offset) for offset in as_offsets(
        given.cpu() if isinstance(given, torch.Tensor) else given)]


def _causal_conv(conv: nn.Conv1d, activation: Optional[str], x: torch.Tensor, comm, layout: str,
                 cu_seqlens: Optional[List[int]]) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn`` (depthwise, causal, then the
    activation, if any) on the shard x [b, l, channels]: each piece reads the
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
    out = torch.cat(outs, dim=2)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype).transpose(1, 2)


# ---- the forwards --------------------------------------------------------------------------

def _own_forward_when_replicated(sharded_forward: Callable[..., torch.Tensor]
                                 ) -> Callable[..., torch.Tensor]:
    """``sharded_forward``, except on tokens every rank runs alike inside
    generate (decode): there the module's own forward, on generate's cache
    (its second argument: ``cache``, ``cache_params`` or, LFM2 at transformers
    5.17, ``past_key_values``)."""

    @functools.wraps(sharded_forward)
    def forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: Optional[torch.Tensor] = None, cache_params: Any = None,
                **kwargs: Any) -> torch.Tensor:
        if cache_params is None:
            cache_params = kwargs.pop("past_key_values", None)
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


@_own_forward_when_replicated
def _short_conv_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                        attention_mask: Optional[torch.Tensor] = None, cache_params: Any = None,
                        **kwargs: Any) -> torch.Tensor:
    """LFM2's ``Lfm2ShortConv`` forward (LFM2-MoE's and LFM3's are the same),
    without a cache, on this rank's shard (inside generate's prefill, its
    conv state kept): the input projection's B, C and x, the depthwise
    causal convolution of B * x (no activation, no state beside it), C times
    that, the output projection."""
    sharded, layout, documents, states = _checked_call(
        self, cache if cache is not None else cache_params, attention_mask, kwargs)
    if kwargs.get("seq_idx") is not None:
        raise ValueError(f"{type(self).__name__} (recurrent_parallel) got seq_idx: packed "
                         f"documents travel as cu_seq_lens_q (make the batch with shard_batch)")
    B, C, x = self.in_proj(hidden_states).chunk(3, dim=-1)
    conv_input = B * x
    out = C * _causal_conv(self.conv, None, conv_input, sharded.comm, layout, documents)
    if states is not None:
        keep_states(states, self.layer_idx, None, conv_input, self.conv.kernel_size[0],
                    sharded.comm, layout, documents)
    return self.out_proj(out)


@dataclass(frozen=True)
class Family:
    """A mixer class recurrent_parallel knows: the forward that replaces its
    own, and the attributes that forward reads (checked at patch time, so a
    transformers version that changed the module is refused, not misread)."""

    forward: Callable[..., torch.Tensor]
    attributes: Tuple[str, ...]
    conv: str = "conv1d"  # the attribute holding its short causal convolution


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
_SHORT_CONV = Family(_short_conv_forward, ("in_proj", "conv", "out_proj", "layer_idx"),
                     conv="conv")

# the mixer classes, by name (their modules are imported only with their models)
FAMILIES: Dict[str, Family] = {
    "Qwen3NextGatedDeltaNet": _GATED_DELTA_NET,
    "BambaMixer": _BAMBA,
    "GraniteMoeHybridMambaLayer": _BAMBA,
    "FalconH1Mixer": _FALCON_H1,
    "Lfm2ShortConv": _SHORT_CONV,
    "Lfm2MoeShortConv": _SHORT_CONV,  # LFM2-MoE's, the same module
    "Lfm3ShortConv": _SHORT_CONV,     # transformers 5.25 on
}


def _refusal(mixer: Mixer) -> Optional[str]:
    """Why this token-mixing module cannot be made parallel (None: it can)."""
    kind = type(mixer.module).__name__
    if mixer.kind == "parallel":
        return f"{kind} is already context-parallel: recurrent_parallel was called twice"
    if kind not in FAMILIES:
        return (f"{mixer.describe()} mixes tokens along the sequence, and recurrent_parallel "
                f"does not implement it (it makes {', '.join(FAMILIES)} context-parallel)")
    return None


def _shape_refusal(module: nn.Module) -> Optional[str]:
    """Why a module of a class recurrent_parallel knows is not the module it
    computes (None: it is): checked before the model runs for the probe, where
    a module missing what its own forward reads would fail unexplained."""
    kind = type(module).__name__
    family = FAMILIES[kind]
    missing = [name for name in family.attributes if not hasattr(module, name)]
    if missing:
        return (f"{kind} lacks {', '.join(missing)}: this transformers version's module is not "
                f"the one recurrent_parallel computes (checked against transformers 5.17 to "
                f"5.25)")
    conv = getattr(module, family.conv)
    depthwise = isinstance(conv, nn.Conv1d) and \
        conv.groups == conv.in_channels == conv.out_channels
    if not depthwise or conv.stride != (1,) or conv.dilation != (1,) or conv.kernel_size[0] < 2:
        return (f"{kind}.{family.conv} is not a depthwise causal convolution of stride 1 and "
                f"kernel >= 2 (found {conv})")
    if family is _SHORT_CONV and module.in_proj.out_features != 3 * conv.in_channels:
        return (f"{kind}.in_proj gives {module.in_proj.out_features} features, not B, C and x "
                f"of the {conv.in_channels} channels its conv convolves")
    return None


class _PositionHook:
    """A forward pre-hook of the model's decoder: its ``position_ids`` (the
    decoder's own 0 .. l-1 when none are given) must be this rank's in the
    layout the mixers read, as the attention checks its own, so that a model
    with no commlib attention is checked too (inside generate, which shards
    itself, nothing). An object, so that a copied model's hook reads the
    copy's config."""

    def __init__(self, sharded: _Sharded):
        self.sharded = sharded
        self.checks: Dict[str, PositionCheck] = {}

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_PositionHook":
        return _PositionHook(copy.deepcopy(self.sharded, memo))

    def __call__(self, decoder: nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> None:
        comm, name = self.sharded.comm, self.sharded.config._attn_implementation
        tokens = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if comm.size == 1 or name not in LAYOUTS or tokens is None or probing() or \
                prefill() is not None or replicated_states() is not None:
            return  # a name not commlib's: each mixer refuses it when called
        length = tokens.shape[1]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(length)[None]
        if name not in self.checks:
            self.checks[name] = PositionCheck(name, LAYOUTS[name], comm)
        self.checks[name](positions, _documents(kwargs), length)


def recurrent_parallel(model: nn.Module, comm) -> nn.Module:
    """Make every recurrent mixer of ``model`` (Gated DeltaNet: Qwen3-Next;
    Mamba2: Bamba, Granite-MoE-Hybrid, Falcon-H1; the short convolution of
    LFM2, LFM2-MoE and LFM3) context-parallel over
    ``comm``, in place (collective): each runs on this rank's shard of the
    sequence, in the layout of the model's commlib attention
    (``config._attn_implementation``, read at every forward), its
    convolution reading the tokens before the shard and its state the state
    before it, both reset at packed documents' starts. Parameters are not
    split (sum their gradients with ``allreduce_gradients``); experts may be
    split too (``expert_parallel``). Turns ``config.use_cache`` off: the
    sharded forward is the training / prefill one, and a cache is refused
    (``commlib.bindings.transformers.generate`` generates with the model).
    A model without recurrent mixers, or with a module that mixes tokens
    along the sequence of a family (or transformers version) it does not
    implement, raises ValueError on every rank, unchanged: the mixers are
    found by running the model (``_token_mixers``), not by
    their names. Every later forward of the model first checks that its
    ``position_ids`` are this rank's in the layout the mixers read (a batch
    sharded for another layout is refused, attention or not)."""
    mixers: List[Mixer] = []
    refusals = [reason for reason in map(_shape_refusal, (
        module for module in model.modules()
        if type(module).__name__ in FAMILIES and not is_parallel_mixer(module)))
        if reason is not None]
    if not refusals:
        try:
            mixers = [m for m in probed(model, is_parallel_mixer) if m.kind != "attention"]
        except ValueError as failed:
            refusals.append(str(failed))
        refusals += [reason for reason in map(_refusal, mixers) if reason is not None]
        if not mixers and not refusals:
            refusals.append(f"{type(model).__name__} has no recurrent mixer (no layer mixes "
                            f"tokens along the sequence but its attention)")
    problem = ValueError("; ".join(dict.fromkeys(refusals))) if refusals else None
    comm.agree("transformers.recurrent_parallel", *(type(m.module).__name__ for m in mixers),
               problem=problem)
    sharded = _Sharded(comm, model.config)
    for mixer in mixers:
        setattr(mixer.module, _SHARDED, sharded)
        mixer.module.forward = types.MethodType(FAMILIES[type(mixer.module).__name__].forward,
                                                mixer.module)
    _documents_through_callers(model, [mixer.module for mixer in mixers])
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    decoder.register_forward_pre_hook(_PositionHook(sharded), with_kwargs=True)
    model.config.use_cache = False
    return model
