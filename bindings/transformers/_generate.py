"""``generate``: transformers' ``model.generate`` over a context-parallel
world, with the KV cache sharded by position (``commlib.inference``).

Every rank calls ``generate(model, input_ids, comm, **generate_kwargs)``
with the same full ``input_ids``, as it would call
``model.generate(input_ids, **generate_kwargs)``:

1. **Prefill**, sharded: the prompt in the layout of a commlib attention
   implementation (``shard_batch``), attended by it (Ring by default), each
   rank keeping its shard's K and V in a ``ShardedKVCache``; the last
   position's logits go from the rank that holds it to every rank.
2. **Decode**, replicated: every rank runs the model on the same new token;
   each layer keeps the token's K and V on rank ``position % P`` and
   attends over the sharded cache (``decode_attention``: one all-gather of
   small partials, the same bits everywhere, so every rank picks the same
   token, greedy or sampled from a seed they share). Expert-parallel MoE
   layers dispatch each token once (``replicated_tokens``).
3. **Another turn**: ``generate(model, longer_ids, comm,
   past_key_values=out.past_key_values)`` prefills only the new tokens,
   striped by position, against the cache (``chunk_attention``: pass-Q or
   pass-KV, whichever moves fewer bytes), or replicated when there are
   fewer new tokens than ranks.

Hybrid models (``recurrent_parallel``: Gated DeltaNet, Mamba2) keep their
recurrent layers' states in a transformers cache of their own, carried by
the ``ShardedKVCache`` (``_recurrent_generation``): the sharded
prefill leaves there each layer's final state and conv state of the whole
prompt, on every rank; decode runs the mixers' own forward on it. A later
turn's new tokens run replicated (every rank all of them: a recurrence
reads its tokens in order, which the striped chunk is not); compiled decode
is refused for them.

With ``compile_decode=True`` the decode step (the model on one token) is
``torch.compile(fullgraph=True)``'d once: the cache's new tokens go to a
``bindings.torch._inference.DecodeCache`` (fixed buffers, positions and
count on the device), so no step changes a shape or reads the device, and
the step compiles once for the whole call; the tokens are eager's.

The cache keeps a layer per attention call of a forward, in the order
the forward makes them (``_Step.slot``): a layer that attends twice
(DiffLlama's two softmaxes over the same keys) or a module that serves
several layers (HRM-text's stacks, run in cycles) gets a cache layer per
call, which transformers' ``layer_idx`` would not give it.

The model runs under an attention implementation of its own for the call
(``"commlib_generate"``); its configured one is restored afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList

from commlib.inference import ShardedKVCache, chunk_attention, decode_attention, striped
from commlib.sequence.documents import local_index, packing_for

from ..torch import DecodeCache
from ._attention import (
    LAYOUTS,
    SINKS,
    SOFTCAP,
    attention_chunk,
    check_call,
    implementations,
    mask_function,
    temperature_floor,
    window_of,
)
from ._batch import sharded_batch
from ._expert_rebalance import Rebalancer
from ._experts import IMPLEMENTATION as EXPERTS
from ._experts import expert_modules, replicated_tokens
from ._model_check import model_problem
from ._recurrent import has_parallel_recurrent_layers
from ._recurrent_generation import generation_states, recurrent_states

__all__ = ["generate", "GENERATION"]

GENERATION = "commlib_generate"  # the attention implementation a generate call runs under

# options that change which token is picked, accepted only at their neutral values
_UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
                "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
                "encoder_repetition_penalty": 1.0, "length_penalty": 1.0, "typical_p": 1.0,
                "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
                "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None,
                "guidance_scale": None, "watermarking_config": None, "penalty_alpha": None,
                "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "top_h": None,
                "prompt_lookup_num_tokens": None, "constraints": None,
                "force_words_ids": None, "stop_strings": None, "max_time": None,
                "exponential_decay_length_penalty": None}


@dataclass
class _Plan:
    """One call's generation, resolved by transformers' own steps as
    ``model.generate`` resolves it: its config, the total length, the
    logits processors (min length, temperature, top-k, top-p, in
    transformers' order), eos and pad."""

    config: GenerationConfig
    max_length: int
    processors: LogitsProcessorList
    eos: List[int]
    pad: Optional[int]
    digest: str  # the options, to agree on


# who made an attention call: the module's class and layer_idx
Caller = Tuple[str, Optional[int]]


@dataclass
class _Step:
    """What the model's current forward is, for the attention: its tokens'
    positions (this rank's, or everyone's when ``replicated``), the cache
    they go to (None in the first prefill, whose K and V are ``kept`` for
    the cache made after it, a layer per call), and for the first prefill
    the documents' offsets."""

    cache: Optional[ShardedKVCache]
    positions: np.ndarray
    replicated: bool
    offsets: Optional[List[int]] = None   # the first prefill's cu_seqlens
    layout: Optional[str] = None          # and its layout
    method: str = "auto"                  # a chunk's pass-Q or pass-KV
    states: Any = None                    # a hybrid model's recurrent states (a transformers Cache)
    calls: List[Caller] = field(default_factory=list)  # this forward's attention calls so far
    kept: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def slot(self, module: torch.nn.Module) -> int:
        """The cache layer of this attention call: its place among the
        forward's calls, which must be those of the first prefill's forward
        (the same modules in the same order: each keeps its K and V in its
        own layer)."""
        slot, caller = len(self.calls), _caller(module)
        self.calls.append(caller)
        callers = [] if self.cache is None else self.cache.callers
        if self.cache is not None and (slot >= len(callers) or callers[slot] != caller):
            made = _describe(callers[slot]) if slot < len(callers) else "no such call"
            raise ValueError(f"{_describe(caller)} makes attention call {slot} of this "
                             f"forward, where the first prefill's forward had {made}: "
                             f"commlib's generate keeps each call's K and V by its place among "
                             f"the forward's attention calls, so every forward must make the "
                             f"same calls in the same order")
        return slot

    def check_calls(self) -> None:
        """After the forward: it made every call the cache has a layer for."""
        if self.cache is not None and len(self.calls) != len(self.cache.callers):
            raise ValueError(f"this forward made {len(self.calls)} attention calls, the first "
                             f"prefill's {len(self.cache.callers)}: commlib's generate keeps "
                             f"a cache layer per call, so every forward must make the same "
                             f"calls")


def _caller(module: torch.nn.Module) -> Caller:
    return type(module).__name__, getattr(module, "layer_idx", None)


def _describe(caller: Caller) -> str:
    kind, layer = caller
    return kind if layer is None else f"{kind} (layer {layer})"


_ACTIVE: contextvars.ContextVar[Optional[_Step]] = contextvars.ContextVar("commlib_generate",
                                                                          default=None)


def generate(model: torch.nn.Module, input_ids: torch.Tensor, comm, *,
             past_key_values: Optional[ShardedKVCache] = None, seed: Optional[int] = None,
             prefill: Optional[str] = None, prefill_method: str = "auto",
             compile_decode: bool = False, rebalance_every: Optional[int] = None,
             redundant_experts: Optional[int] = None, **generate_kwargs: Any) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` over ``comm``, on
    every rank with the same ``input_ids`` [batch, length] (rows of equal
    length: no padding). The options are resolved by transformers' own
    steps, the model's ``generation_config`` and its defaults included (20
    new tokens when neither ``max_new_tokens`` nor ``max_length`` is
    given), and what ``model.generate`` refuses is refused. Greedy (the
    default; draws no random number) or sampled (``do_sample=True`` with
    ``temperature``, ``top_k``, ``top_p``): with ``seed=s`` from a generator
    of its own seeded ``s`` (the tokens of ``torch.manual_seed(s);
    model.generate(...)``, the global generator untouched), else from
    torch's global generator in rank 0's state, which every rank is left in
    as ``model.generate`` leaves rank 0's. ``min_new_tokens`` /
    ``min_length``, ``eos_token_id`` (int or list), ``pad_token_id``;
    ``return_dict_in_generate=True`` returns transformers'
    ``GenerateDecoderOnlyOutput`` whose cache is this rank's
    ``ShardedKVCache`` (pass it as ``past_key_values`` to continue the
    conversation). ``prefill``: the commlib attention implementation of
    the first prefill (default: the model's, if one of commlib's, else
    ``"commlib_ring"``); ``prefill_method``: a later turn's "pass_q",
    "pass_kv" or "auto". ``compile_decode``: the decode step compiled
    (``torch.compile(fullgraph=True)``, one trace for the call; dense
    models). ``rebalance_every``: on a model made ``expert_parallel``,
    every that many decode steps each experts module's load since its last
    rebalance chooses a new placement (``commlib.moe.rebalance`` from the
    current one, with ``redundant_experts`` replicas beyond one per expert;
    default as many as it has now); the weights that move travel while the
    old placement answers the next step, and every rank switches after it
    (vLLM's EPLB; the tokens are a run's without it). Anything else that
    changes the picked tokens (beams, penalties, masked tokens, ...) is
    refused on every rank."""
    name = prefill or _model_layout_name(model)
    plan, problem = _plan(model, input_ids, generate_kwargs)
    if problem is None:
        problem = _input_problem(model, input_ids, past_key_values, plan, name, comm,
                                 prefill_method, compile_decode) or \
            _rebalance_problem(model, rebalance_every, redundant_experts, compile_decode)
    comm.agree("transformers.generate", tuple(input_ids.shape), _history(input_ids),
               None if plan is None else plan.digest, seed, name, prefill_method,
               None if past_key_values is None else past_key_values.digest(),
               bool(compile_decode), rebalance_every, redundant_experts, problem=problem)
    cache = past_key_values
    sampler = _Sampler(plan.processors, _generator(plan, seed, comm, input_ids.device))
    rebalancer = None if rebalance_every is None else \
        Rebalancer(model, comm, rebalance_every, redundant_experts)
    with _generation_attention(model, comm, name) as decoding:
        if cache is None:
            logits, cache = _first_prefill(model, input_ids, comm, name)
        else:
            logits = _prefill(model, input_ids, cache, comm, prefill_method)
        unrolled = _compile_problem(cache.callers) if compile_decode else None
        if unrolled is not None:  # known once a forward ran; the same on every rank
            raise unrolled
        stepper = _CompiledDecode(model, cache, comm, decoding, plan.max_length,
                                  input_ids.shape[0], input_ids.device) \
            if compile_decode else None
        sequences, scores = _decode(model, input_ids, cache, comm, logits, sampler, plan,
                                    stepper, rebalancer)
    cache.history = _history(sequences[:, :cache.length])
    if not plan.config.return_dict_in_generate:
        return sequences
    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=tuple(scores) if plan.config.output_scores else None,
        **{"cache" if "cache" in fields else "past_key_values": cache})


# -- checks ---------------------------------------------------------------------
def _plan(model, input_ids: torch.Tensor,
          kwargs: Dict[str, Any]) -> Tuple[Optional[_Plan], Optional[ValueError]]:
    """The call resolved as ``model.generate`` resolves it (transformers'
    own steps, in its order), or what generate refuses of it."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or \
            input_ids.shape[1] == 0:
        return None, ValueError(f"input_ids must be a tensor [batch, length] with length >= 1, "
                                f"got shape {tuple(getattr(input_ids, 'shape', ()))}")
    kwargs = dict(kwargs)
    given = kwargs.pop("generation_config", None)
    mask = kwargs.pop("attention_mask", None)
    # as model.generate tells a default length from a set one, before resolving
    default_max, default_min = (kwargs.get(key) is None
                                and (given is None or getattr(given, key) is None)
                                and getattr(model.generation_config, key) is None
                                for key in ("max_length", "min_length"))
    try:
        config, unknown = model._prepare_generation_config(given, **kwargs)
    except ValueError as error:
        return None, ValueError(f"model.generate refuses these options: {error}")
    digest = repr(sorted((key, repr(value)) for key, value in config.to_dict().items())) + \
        repr(None if mask is None else (tuple(mask.shape), _history(mask)))
    refused = sorted(unknown) + [key for key, neutral in _UNSUPPORTED.items()
                                 if getattr(config, key, None) not in (neutral, None)]
    if refused:
        return None, ValueError(f"commlib's generate does not implement "
                                f"{', '.join(refused)} (they change the picked tokens); it "
                                f"does greedy and sampling with temperature, top_k, top_p")
    prompt = input_ids.shape[1]
    model._prepare_special_tokens(config, mask is not None, device=input_ids.device,
                                  batch_size=input_ids.shape[0])
    model._prepare_generated_length(generation_config=config, has_default_max_length=default_max,
                                    has_default_min_length=default_min,
                                    model_input_name="input_ids", input_ids_length=prompt,
                                    inputs_tensor=input_ids)
    try:
        model._validate_generated_length(config, prompt, default_max)
        processors = model._get_logits_processor(generation_config=config,
                                                 input_ids_seq_length=prompt,
                                                 encoder_input_ids=input_ids,
                                                 device=input_ids.device, model_kwargs={})
    except ValueError as error:
        return None, ValueError(f"model.generate refuses this call: {error}")
    problem = _mask_problem(model, input_ids, mask, config)
    if problem is not None:
        return None, problem
    eos, pad = config._eos_token_tensor, config._pad_token_tensor
    return _Plan(config, int(config.max_length), processors,
                 [] if eos is None else [int(t) for t in eos.reshape(-1)],
                 None if pad is None else int(pad), digest), None


def _mask_problem(model, input_ids: torch.Tensor, mask: Any,
                  config: GenerationConfig) -> Optional[ValueError]:
    """A token the attention would mask, which generate does not do (the
    cache shares one position per column across the batch): an
    ``attention_mask`` with a zero, or, without one, the pad token in the
    prompt where ``model.generate`` infers the mask from it."""
    if mask is not None:
        mask = torch.as_tensor(mask)
        if tuple(mask.shape) != tuple(input_ids.shape):
            return ValueError(f"attention_mask must be [batch, length] like input_ids "
                              f"{tuple(input_ids.shape)}, got {tuple(mask.shape)}")
        if not bool((mask != 0).all()):
            return ValueError(
                "the attention_mask masks some tokens (padding), which commlib's generate "
                "does not do: model.generate would skip them and shift the later positions, "
                "and the sharded cache shares positions across the batch; remove the padded "
                "tokens and generate rows of one length together, or one at a time")
        return None
    inferred = model._prepare_attention_mask_for_generation(input_ids, config, {})
    if bool((inferred != 0).all()):
        return None
    pad = int(config._pad_token_tensor)
    return ValueError(
        f"input_ids contain pad_token_id {pad} and no attention_mask was given: "
        f"model.generate would mask those tokens (and shift the later positions), which "
        f"commlib's generate does not do; remove them, or pass "
        f"attention_mask=torch.ones_like(input_ids) to attend them as ordinary tokens")


def _input_problem(model, input_ids: torch.Tensor, cache: Optional[ShardedKVCache],
                   plan: _Plan, name: str, comm, prefill_method: str,
                   compile_decode: bool) -> Optional[ValueError]:
    """What is wrong with this call's inputs on this rank (None: nothing)."""
    unparallel = model_problem(model, comm, before="generate", attention_replaced=True,
                               longest=input_ids.shape[1])
    if unparallel is not None:
        return unparallel
    recurrent = has_parallel_recurrent_layers(model)
    if recurrent and compile_decode:
        return ValueError("compile_decode is not implemented for models with recurrent layers "
                          "(recurrent_parallel): generate them without it")
    if name not in LAYOUTS:
        return ValueError(f"prefill {name!r} is not one of commlib's attention "
                          f"implementations ({', '.join(LAYOUTS)})")
    if prefill_method not in ("auto", "pass_q", "pass_kv"):
        return ValueError(f"prefill_method must be 'auto', 'pass_q' or 'pass_kv', got "
                          f"{prefill_method!r}")
    total, prompt = plan.max_length, input_ids.shape[1]
    most = getattr(model.config, "max_position_embeddings", None)
    if most is not None and total > most:
        return ValueError(f"the prompt ({prompt} tokens) and the new tokens "
                          f"({total - prompt}) exceed the model's "
                          f"{most} positions (config.max_position_embeddings)")
    chunk = attention_chunk(model.config.get_text_config())
    if chunk is not None and total > chunk:
        fix = f"generate at most {chunk - prompt} new tokens" if chunk > prompt else \
            "run this model unsharded"
        return ValueError(f"{type(model).__name__} attends within chunks of {chunk} tokens "
                          f"(config.attention_chunk_size: Llama 4's chunked attention), and "
                          f"this call reaches {total} tokens (the prompt's {prompt} and up to "
                          f"{total - prompt} new); commlib's generate does not implement "
                          f"chunked attention, which within {chunk} tokens is the causal "
                          f"attention it computes: {fix}")
    tuned = [(module, temperature_floor(module)) for module in model.modules()
             if temperature_floor(module) is not None]
    if tuned and total >= min(floor for _, floor in tuned):
        module, floor = min(tuned, key=lambda pair: pair[1])
        return ValueError(f"{_describe(_caller(module))} tunes its attention temperature by "
                          f"each token's index among those it is given (Llama 4's layers "
                          f"without RoPE: config.attn_temperature_tuning, "
                          f"floor_scale={floor}), which in commlib's generate counts a "
                          f"shard's tokens or the one decoded, not the sequence's: this call "
                          f"reaches {total} tokens, past {floor - 1}, where it would scale "
                          f"differently from model.generate. Keep the prompt and new tokens "
                          f"within {floor - 1}, or set config.attn_temperature_tuning = False")
    if cache is None:
        return None
    if not isinstance(cache, ShardedKVCache):
        return ValueError(f"past_key_values must be the ShardedKVCache a previous generate "
                          f"returned, got {type(cache).__name__}")
    problem = cache.problem(comm.size, comm.rank)
    if problem is not None:
        return problem
    if recurrent != (_recurrent_states_of(cache) is not None):
        return ValueError("past_key_values must come from a generate on this model: a model "
                          "with recurrent layers continues only a cache holding their states, "
                          "and a model without them only a cache without")
    callers = getattr(cache, "callers", None)
    if callers is None:
        return ValueError("past_key_values must be the ShardedKVCache a previous generate "
                          "returned (it knows which attention call keeps each of its layers)")
    present = {_caller(module) for module in model.modules()}
    strangers = [_describe(caller) for caller in callers if caller not in present]
    if strangers:
        return ValueError(f"the cache comes from another model: its layers were kept by "
                          f"attention calls of {', '.join(strangers[:3])}, which this "
                          f"{type(model).__name__} does not have")
    if compile_decode:
        return _compile_problem(callers)
    if input_ids.shape[1] <= cache.length or cache.history != _history(
            input_ids[:, :cache.length]):
        return ValueError(f"the cache holds the first {cache.length} tokens of another "
                          f"conversation: input_ids must start with those tokens and add "
                          f"new ones")
    return None


def _rebalance_problem(model, every: Any, redundant: Any,
                       compile_decode: bool) -> Optional[ValueError]:
    """What is wrong with this call's ``rebalance_every`` and
    ``redundant_experts`` (None: nothing)."""
    if every is None:
        return None if redundant is None else ValueError(
            "redundant_experts applies only with rebalance_every (the replicas a rebalance "
            "places); give both, or neither")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        return ValueError(f"rebalance_every must be a number of decode steps >= 1, got "
                          f"{every!r}")
    if redundant is not None and (isinstance(redundant, bool) or not isinstance(redundant, int)
                                  or redundant < 0):
        return ValueError(f"redundant_experts must be an int >= 0, got {redundant!r}")
    if not expert_modules(model):
        return ValueError("rebalance_every needs a model made expert_parallel (its experts "
                          "placed over the ranks): call expert_parallel(model, comm) first")
    if compile_decode:
        return ValueError("rebalance_every is not implemented with compile_decode: a switch "
                          "replaces the expert parameters and Dispatchers that the compiled "
                          "step was traced with; generate with one or the other")
    return None


def _compile_problem(callers: List[Caller]) -> Optional[ValueError]:
    """The compiled decode step keeps each call's K and V in the cache layer
    of its module's ``layer_idx`` (a fixed index: nothing counted while
    traced), which is its place among the forward's calls only when every
    layer attends once, in order."""
    if [layer for _, layer in callers] == list(range(len(callers))):
        return None
    shown = ", ".join(_describe(caller) for caller in callers[:4])
    return ValueError(f"compile_decode is not implemented for a model whose attention calls "
                      f"are not one per layer in order (here {len(callers)} calls: {shown}"
                      f"{', ...' if len(callers) > 4 else ''}; a layer that attends twice, "
                      f"as DiffLlama's, or layers run again, as HRM-text's stacks): generate "
                      f"it without compile_decode")


def _history(tokens: torch.Tensor) -> int:
    """A fingerprint of the token ids (the same tokens on every rank)."""
    return zlib.crc32(np.ascontiguousarray(tokens.detach().cpu().numpy()).tobytes()) \
        ^ zlib.crc32(repr(tuple(tokens.shape)).encode())


def _recurrent_states_of(cache: ShardedKVCache) -> Any:
    """The recurrent layers' states a generate left with ``cache`` (None: a
    model without recurrent layers)."""
    return getattr(cache, "recurrent", None)


def _model_layout_name(model: torch.nn.Module) -> str:
    name = getattr(model.config, "_attn_implementation", None)
    return name if name in LAYOUTS else "commlib_ring"


# -- the attention the model runs under ----------------------------------------
@dataclass
class _Decoding:
    """The compiled decode step's state, read by the attention of this
    call (a plain attribute: ``torch.compile`` does not trace a ContextVar):
    the cache and the step's positions [1] on the device; None outside it."""

    cache: Optional[DecodeCache] = None
    positions: Optional[torch.Tensor] = None


@contextlib.contextmanager
def _generation_attention(model: torch.nn.Module, comm, name: str) -> Iterator[_Decoding]:
    """The model switched to ``"commlib_generate"`` over ``comm`` (the first
    prefill by ``name``), and back afterwards."""
    attend = implementations(comm)[name]
    decoding = _Decoding()
    AttentionInterface.register(GENERATION, _attention(attend, comm, decoding))
    AttentionMaskInterface.register(GENERATION, mask_function(GENERATION, comm))
    previous = model.config._attn_implementation
    model.set_attn_implementation(GENERATION)
    try:
        yield decoding
    finally:
        model.set_attn_implementation(previous)


def _attention(attend: Callable, comm, decoding: _Decoding) -> Callable:
    """The attention transformers calls per layer during generate: keep the
    step's K and V in the cache (in the first prefill, for the cache made
    after it), then attend: the first prefill's sharded attention, a chunk
    against the cache, or replicated tokens over it."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
        if decoding.cache is not None:
            return _decode_attention(decoding, module, query, key, value, attention_mask,
                                     dropout, scaling, is_causal, sliding_window, kwargs), None
        step = _ACTIVE.get()
        if step is None:
            raise RuntimeError(f"{GENERATION!r} attends only inside "
                               f"commlib.bindings.transformers.generate")
        kwargs.pop("position_ids", None)
        check_call(GENERATION, module, attention_mask, dropout, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        length = step.offsets[-1] if step.cache is None else step.cache.length
        window = window_of(GENERATION, sliding_window, length, causal)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        slot = step.slot(module)
        settings = dict(causal=causal, window=window, softmax_scale=scaling,
                        sinks=kwargs.get(SINKS), softcap=kwargs.get(SOFTCAP))
        if step.cache is None:
            step.kept.append((k, v))
            return attend(q, k, v, cu_seqlens=step.offsets, **settings), None
        keys, values = step.cache.store(slot, k, v)
        if step.replicated:
            out = decode_attention(q, keys, values, comm, q_positions=step.positions,
                                   k_positions=step.cache.positions, **settings)
        else:
            out = chunk_attention(q, keys, values, comm, q_positions=step.positions,
                                  k_positions=step.cache.positions, method=step.method,
                                  **settings)
        return out, None

    attention.__name__ = attention.__qualname__ = GENERATION
    return attention


def _decode_attention(decoding: _Decoding, module: torch.nn.Module, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float,
                      scaling: Optional[float], is_causal: Optional[bool],
                      sliding_window: Optional[int], kwargs: Dict[str, Any]) -> torch.Tensor:
    """A compiled decode step's attention: the token's K and V into the
    DecodeCache, then ``decode_attention`` over it, nothing read back. A
    window is passed whenever the model has one (one that covers the
    sequence hides nothing), so no step's settings differ."""
    kwargs.pop("position_ids", None)
    check_call(GENERATION, module, attention_mask, dropout, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = window_of(GENERATION, sliding_window, (sliding_window or 0) + 1, causal)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    decoding.cache.store(module.layer_idx, k, v)
    return decoding.cache.attend(module.layer_idx, q, decoding.positions, causal=causal,
                                 window=window, softmax_scale=scaling, sinks=kwargs.get(SINKS),
                                 softcap=kwargs.get(SOFTCAP))


def _expert_parallel(model: torch.nn.Module) -> bool:
    return any(getattr(getattr(module, "config", None), "_experts_implementation", None)
               == EXPERTS for module in model.modules())


class _CompiledDecode:
    """The model on one replicated token, compiled once for the call, over
    a DecodeCache made from the sharded cache (room for every token the
    call may add) and written back into it at the end (``finish``)."""

    def __init__(self, model, cache: ShardedKVCache, comm, decoding: _Decoding,
                 max_length: int, batch: int, device: torch.device):
        self.model, self.sharded, self.decoding = model, cache, decoding
        config = model.config
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        like = torch.empty((batch, 0, config.num_key_value_heads, head_dim), dtype=model.dtype,
                           device=device)
        room = cache.tokens + math.ceil(max(max_length - cache.length, 0) / comm.size) + 1
        decoding.cache = DecodeCache.from_sharded(cache, comm, room, like=like)
        decoding.positions = torch.zeros(1, dtype=torch.int64, device=device)
        self.tokens = torch.zeros((batch, 1), dtype=torch.int64, device=device)
        # an expert-parallel model's experts break the graph (they read
        # whether tokens are replicated from a ContextVar, which dynamo does
        # not trace): compiled around them
        self.step = torch.compile(self._step, fullgraph=not _expert_parallel(model))

    def _step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.decoding.cache.advance(positions)
        position_ids = positions[None].expand(tokens.shape[0], -1)
        return self.model(input_ids=tokens, position_ids=position_ids, use_cache=False,
                          logits_to_keep=1).logits[:, -1]

    def logits(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The last token's logits [batch, vocab] (float32) for ``tokens``
        [batch, 1] at ``position``, the same on every rank."""
        # the tensors the graph reads, their layout fixed: no retrace
        self.decoding.positions.fill_(position)
        self.tokens.copy_(tokens)
        with torch.no_grad(), replicated_tokens():
            return self.step(self.tokens, self.decoding.positions).float()

    def finish(self, length: int) -> None:
        """The decoded tokens' K and V into the sharded cache (``length``
        tokens over all ranks), and the attention back to the cache's."""
        self.decoding.cache.into(self.sharded, length)
        self.decoding.cache = self.decoding.positions = None


def _forward(model: torch.nn.Module, step: _Step, keep: torch.Tensor,
             **inputs: Any) -> torch.Tensor:
    """The model on this step's tokens; the logits of the rows ``keep``
    (indices along the sequence) [batch, len(keep), vocab]."""
    token = _ACTIVE.set(step)
    try:
        with torch.no_grad(), (replicated_tokens() if step.replicated
                               else contextlib.nullcontext()), \
                (contextlib.nullcontext() if step.states is None
                 else generation_states(step.states, layout=step.layout)):
            logits = model(use_cache=False, logits_to_keep=keep, **inputs).logits
        step.check_calls()
        return logits
    finally:
        _ACTIVE.reset(token)


# -- prefill and decode ----------------------------------------------------------
def _prefill(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm,
             method: str) -> torch.Tensor:
    """The tokens ``cache`` (of an earlier turn) lacks, run through the
    model into it; returns the last position's logits [batch, vocab]
    (float32), on every rank."""
    start, length = cache.length, input_ids.shape[1]
    new = np.arange(start, length)
    # too few to shard, or a recurrence to read in order: every rank runs them all
    if new.size < comm.size or _recurrent_states_of(cache) is not None:
        return _replicated(model, input_ids[:, start:], new, cache, comm)
    mine = new[striped(new, comm.size, comm.rank)]
    cache.admit(mine, np.arange(mine.size), length)
    holder = (length - 1) % comm.size
    step = _Step(cache, mine, replicated=False, method=method)
    return _from(comm, _last_logits(model, step, input_ids[:, mine], mine), holder)


def _first_prefill(model, input_ids: torch.Tensor, comm,
                   name: str) -> Tuple[torch.Tensor, ShardedKVCache]:
    """The prompt sharded in ``name``'s layout and attended by it; returns
    the last position's logits (as ``_prefill``) and the cache it made: a
    layer per attention call of the forward, each holding this rank's
    tokens' K and V."""
    length = input_ids.shape[1]
    shard = sharded_batch({"input_ids": input_ids}, comm, layout=LAYOUTS[name])
    offsets = shard["cu_seq_lens_q"].tolist()
    packing = packing_for(offsets, LAYOUTS[name], comm.size, shard["input_ids"].shape[1])
    index = local_index(packing, comm.rank)
    rows = np.flatnonzero(index >= 0)
    holder = next(r for r in range(comm.size) if (local_index(packing, r) == length - 1).any())
    last = int(np.flatnonzero(index == length - 1)[0]) if comm.rank == holder else 0
    inputs = {key: shard[key] for key in ("input_ids", "position_ids", "cu_seq_lens_q",
                                          "cu_seq_lens_k", "max_length_q", "max_length_k")}
    states = recurrent_states(model.config) if has_parallel_recurrent_layers(model) else None
    step = _Step(None, index[rows], replicated=False, offsets=offsets, layout=LAYOUTS[name],
                 states=states)
    logits = _forward(model, step, torch.tensor([last]), **inputs)
    # a model without attention (its recurrent states carry the prompt) keeps an empty layer
    cache = ShardedKVCache(max(len(step.kept), 1), comm.size, comm.rank)
    cache.admit(index[rows], rows, length)
    for layer, (k, v) in enumerate(step.kept):
        cache.store(layer, k, v)
    cache.prefill, cache.callers, cache.recurrent = (LAYOUTS[name], length), step.calls, states
    return _from(comm, logits[:, -1], holder), cache


def _replicated(model, tokens: torch.Tensor, positions: np.ndarray, cache: ShardedKVCache,
                comm) -> torch.Tensor:
    """``tokens`` [batch, t] at ``positions``, the same on every rank, run
    by every rank; each keeps the K and V of its positions."""
    kept = striped(positions, comm.size, comm.rank)
    cache.admit(positions[kept], kept, int(positions[-1]) + 1)
    step = _Step(cache, positions, replicated=True, states=_recurrent_states_of(cache))
    return _last_logits(model, step, tokens, positions).float()


def _last_logits(model, step: _Step, tokens: torch.Tensor,
                 positions: np.ndarray) -> torch.Tensor:
    """The model on ``tokens`` [batch, t] at global ``positions``: the last
    token's logits [batch, vocab]."""
    position_ids = torch.as_tensor(positions)[None].expand(tokens.shape[0], -1)
    logits = _forward(model, step, torch.tensor([positions.size - 1]), input_ids=tokens,
                      position_ids=position_ids)
    return logits[:, -1]


def _from(comm, logits: torch.Tensor, holder: int) -> torch.Tensor:
    """``holder``'s logits [batch, vocab] on every rank (float32)."""
    return comm.bcast(logits.float().contiguous(), root=holder)


def _decode(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm,
            logits: torch.Tensor, sampler: "_Sampler", plan: _Plan,
            stepper: Optional[_CompiledDecode] = None,
            rebalancer: Optional[Rebalancer] = None
            ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """New tokens, one a step, as model.generate picks them: a finished row
    (its eos picked) takes the pad token from then on; stop when every row
    is finished or the length is reached. ``rebalancer`` sees each decode
    step end, and finishes a move still in flight at the end."""
    sequences, scores = input_ids, []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(plan.eos, dtype=input_ids.dtype, device=input_ids.device)
    for made in range(plan.max_length - input_ids.shape[1]):
        if made and stepper is not None:
            logits = stepper.logits(sequences[:, -1:], sequences.shape[1] - 1)
        elif made:
            position = np.array([sequences.shape[1] - 1])
            logits = _replicated(model, sequences[:, -1:], position, cache, comm)
        if made and rebalancer is not None:
            rebalancer.after_step()
        scored, picked = sampler.pick(sequences, logits)
        scores.append(scored)
        if plan.eos:
            picked = torch.where(done, torch.full_like(picked, plan.pad), picked)
        sequences = torch.cat([sequences, picked[:, None].to(sequences.dtype)], dim=1)
        if plan.eos:
            done |= torch.isin(sequences[:, -1], eos)
        if bool(done.all()):
            break
    if stepper is not None:
        stepper.finish(sequences.shape[1] - 1)
    if rebalancer is not None:
        rebalancer.wait()
    return sequences, scores


def _generator(plan: _Plan, seed: Optional[int], comm,
               device: torch.device) -> Optional[torch.Generator]:
    """What sampling draws from: nothing for greedy; a generator seeded
    ``seed``; else torch's global generator of ``device``, set on every
    rank to rank 0's state (so every rank draws alike and ends alike)."""
    if not plan.config.do_sample:
        return None
    if seed is not None:
        return torch.Generator(device=device).manual_seed(int(seed))
    generator = torch.default_generator if device.type == "cpu" else \
        torch.cuda.default_generators[device.index if device.index is not None
                                      else torch.cuda.current_device()]
    state = generator.get_state()
    generator.set_state(comm.bcast(state, root=0).to(state.dtype))
    return generator


class _Sampler:
    """transformers' logits processors, then the argmax (no generator) or
    a draw from ``generator``, as model.generate's sampling loop does."""

    def __init__(self, processors: LogitsProcessorList, generator: Optional[torch.Generator]):
        self.processors = processors
        self.generator = generator

    def pick(self, sequences: torch.Tensor,
             logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the processed scores, the picked token of each row)."""
        scores = self.processors(sequences, logits.to(sequences.device))
        if self.generator is None:
            return scores, scores.argmax(dim=-1)
        probabilities = torch.softmax(scores, dim=-1)
        return scores, torch.multinomial(probabilities, 1, generator=self.generator)[:, 0]
