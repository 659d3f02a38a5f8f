"""What ``generate`` refuses, and why: the options that change the picked
tokens, masked tokens, inputs the sharded cache cannot continue, and what
compiled decode and expert rebalancing do not implement."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from transformers.generation import GenerationConfig, LogitsProcessorList

from commlib.inference import ShardedKVCache

from ._attention import LAYOUTS, attention_chunk, temperature_floor
from ._experts import expert_modules
from ._generation_attention import Caller, caller_of, describe_caller
from ._latent import is_latent_attention
from ._model_check import model_problem
from ._recurrent import has_parallel_recurrent_layers

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
class GenerationPlan:
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


def plan_generation(model, input_ids: torch.Tensor, kwargs: Dict[str, Any]
                    ) -> Tuple[Optional[GenerationPlan], Optional[ValueError]]:
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
        repr(None if mask is None else (tuple(mask.shape), token_history(mask)))
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
    return GenerationPlan(config, int(config.max_length), processors,
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


def input_problem(model, input_ids: torch.Tensor, cache: Optional[ShardedKVCache],
                  plan: GenerationPlan, name: str, comm, prefill_method: str,
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
    if compile_decode and any(is_latent_attention(module) for module in model.modules()):
        return ValueError(f"compile_decode is not implemented for multi-head latent attention "
                          f"({type(model).__name__}): its decode attends eagerly in the absorbed "
                          f"form over the latent cache; generate it without compile_decode")
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
        return ValueError(f"{describe_caller(caller_of(module))} tunes its attention "
                          f"temperature by each token's index among those it is given "
                          f"(Llama 4's layers without RoPE: config.attn_temperature_tuning, "
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
    if recurrent != (recurrent_states_of(cache) is not None):
        return ValueError("past_key_values must come from a generate on this model: a model "
                          "with recurrent layers continues only a cache holding their states, "
                          "and a model without them only a cache without")
    callers = getattr(cache, "callers", None)
    if callers is None:
        return ValueError("past_key_values must be the ShardedKVCache a previous generate "
                          "returned (it knows which attention call keeps each of its layers)")
    present = {caller_of(module) for module in model.modules()}
    strangers = [describe_caller(caller) for caller in callers if caller not in present]
    if strangers:
        return ValueError(f"the cache comes from another model: its layers were kept by "
                          f"attention calls of {', '.join(strangers[:3])}, which this "
                          f"{type(model).__name__} does not have")
    if compile_decode:
        return compile_problem(callers)
    if input_ids.shape[1] <= cache.length or cache.history != token_history(
            input_ids[:, :cache.length]):
        return ValueError(f"the cache holds the first {cache.length} tokens of another "
                          f"conversation: input_ids must start with those tokens and add "
                          f"new ones")
    return None


def rebalance_problem(model, every: Any, redundant: Any,
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


def compile_problem(callers: List[Caller]) -> Optional[ValueError]:
    """The compiled decode step keeps each call's K and V in the cache layer
    of its module's ``layer_idx`` (a fixed index: nothing counted while
    traced), which is its place among the forward's calls only when every
    layer attends once, in order."""
    if [layer for _, layer in callers] == list(range(len(callers))):
        return None
    shown = ", ".join(describe_caller(caller) for caller in callers[:4])
    return ValueError(f"compile_decode is not implemented for a model whose attention calls "
                      f"are not one per layer in order (here {len(callers)} calls: {shown}"
                      f"{', ...' if len(callers) > 4 else ''}; a layer that attends twice, "
                      f"as DiffLlama's, or layers run again, as HRM-text's stacks): generate "
                      f"it without compile_decode")


def token_history(tokens: torch.Tensor) -> int:
    """A fingerprint of the token ids (the same tokens on every rank)."""
    return zlib.crc32(np.ascontiguousarray(tokens.detach().cpu().numpy()).tobytes()) \
        ^ zlib.crc32(repr(tuple(tokens.shape)).encode())


def recurrent_states_of(cache: ShardedKVCache) -> Any:
    """The recurrent layers' states a generate left with ``cache`` (None: a
    model without recurrent layers)."""
    return getattr(cache, "recurrent", None)
