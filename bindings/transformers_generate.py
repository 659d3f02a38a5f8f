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

The model runs under an attention implementation of its own for the call
(``"commlib_generate"``); its configured one is restored afterwards.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.generation import (
    GenerateDecoderOnlyOutput,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from commlib.documents import local_index, packing_for
from commlib.inference import ShardedKVCache, chunk_attention, decode_attention, striped

from .transformers_attention import (
    LAYOUTS,
    check_call,
    implementations,
    mask_function,
    window_of,
)
from .transformers_batch import shard_batch
from .transformers_experts import replicated_tokens

__all__ = ["generate", "GENERATION"]

GENERATION = "commlib_generate"  # the attention implementation a generate call runs under

# transformers' defaults for the options generate reads (a GenerationConfig
# leaves them None until model.generate resolves them)
_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
             "max_length": 20, "num_beams": 1, "num_return_sequences": 1,
             "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0,
             "min_new_tokens": 0, "length_penalty": 1.0}
# options that change which token is picked, accepted only at their defaults
_UNSUPPORTED = ("num_beams", "num_return_sequences", "repetition_penalty",
                "no_repeat_ngram_size", "min_length", "min_new_tokens", "bad_words_ids",
                "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id",
                "forced_eos_token_id", "sequence_bias", "guidance_scale", "watermarking_config",
                "penalty_alpha", "typical_p", "epsilon_cutoff", "eta_cutoff", "min_p",
                "assistant_model", "prompt_lookup_num_tokens", "constraints",
                "force_words_ids", "stop_strings", "exponential_decay_length_penalty")
# generate()'s own keyword arguments that are not generation options
_OWN = ("attention_mask", "generation_config", "return_dict_in_generate", "output_scores",
        "use_cache")


@dataclass
class _Step:
    """What the model's current forward is, for the attention: its tokens'
    positions (this rank's, or everyone's when ``replicated``), the cache
    they go to, and for the first prefill the documents' offsets."""

    cache: ShardedKVCache
    positions: np.ndarray
    replicated: bool
    offsets: Optional[List[int]] = None   # the first prefill's cu_seqlens
    method: str = "auto"                  # a chunk's pass-Q or pass-KV


_ACTIVE: contextvars.ContextVar[Optional[_Step]] = contextvars.ContextVar("commlib_generate",
                                                                          default=None)


def generate(model: torch.nn.Module, input_ids: torch.Tensor, comm, *,
             past_key_values: Optional[ShardedKVCache] = None, seed: Optional[int] = None,
             prefill: Optional[str] = None, prefill_method: str = "auto",
             **generate_kwargs: Any) -> Any:
    """``model.generate(input_ids, **generate_kwargs)`` over ``comm``, on
    every rank with the same ``input_ids`` [batch, length] (rows of equal
    length: no padding). Greedy (the default) or sampled
    (``do_sample=True`` with ``temperature``, ``top_k``, ``top_p``; every
    rank draws from ``seed``, by default one rank 0 draws from torch's
    global generator); ``max_new_tokens`` / ``max_length``,
    ``eos_token_id``, ``pad_token_id``; ``return_dict_in_generate=True``
    returns transformers' ``GenerateDecoderOnlyOutput`` whose cache is this
    rank's ``ShardedKVCache`` (pass it as ``past_key_values`` to continue the
    conversation). ``prefill``: the commlib attention implementation of
    the first prefill (default: the model's, if one of commlib's, else
    ``"commlib_ring"``); ``prefill_method``: a later turn's "pass_q",
    "pass_kv" or "auto". Anything else that changes the picked tokens
    (beams, penalties, ...) is refused on every rank."""
    options, problem = _options(model, generate_kwargs)
    name = prefill or _model_layout_name(model)
    history = _history(input_ids)
    if problem is None:
        problem = _input_problem(model, input_ids, past_key_values, options, name, comm,
                                 prefill_method)
    comm.agree("transformers.generate", tuple(input_ids.shape), history,
               repr(sorted((k, repr(v)) for k, v in options.items())), seed, name,
               prefill_method, None if past_key_values is None else past_key_values.digest(),
               problem=problem)
    if seed is None:  # one draw, shared
        seed = int(comm.bcast(torch.randint(0, 2 ** 62, (1,)) if comm.rank == 0 else None,
                              root=0)[0])
    cache = past_key_values if past_key_values is not None else ShardedKVCache(
        model.config.num_hidden_layers, comm.size, comm.rank)
    sampler = _Sampler(options, seed, input_ids.device)
    with _generation_attention(model, comm, name):
        logits = _prefill(model, input_ids, cache, comm, name, prefill_method)
        sequences, scores = _decode(model, input_ids, cache, comm, logits, sampler, options)
    cache.history = _history(sequences[:, :cache.length])
    if not options["return_dict_in_generate"]:
        return sequences
    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=tuple(scores) if options["output_scores"] else None,
        **{"cache" if "cache" in fields else "past_key_values": cache})


# -- checks ---------------------------------------------------------------------
def _options(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any],
                                                                      Optional[ValueError]]:
    """The resolved generation options (the model's generation_config,
    updated by ``kwargs``) and what of them generate refuses."""
    config = copy.deepcopy(kwargs.pop("generation_config", None) or model.generation_config)
    own = {key: kwargs.pop(key) for key in _OWN if key in kwargs}
    unknown = config.update(**kwargs)
    options = {key: getattr(config, key, None) for key in
               ("max_new_tokens", "eos_token_id", "pad_token_id") + tuple(_DEFAULTS)}
    for key, default in _DEFAULTS.items():
        if options[key] is None:
            options[key] = default
    options.update(return_dict_in_generate=bool(own.get("return_dict_in_generate",
                                                        config.return_dict_in_generate)),
                   output_scores=bool(own.get("output_scores", config.output_scores)))
    refused = sorted(unknown) + [key for key in _UNSUPPORTED
                                 if getattr(config, key, None) not in (None, _DEFAULTS.get(key),
                                                                       [], {})]
    mask = own.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).all()):
        return options, ValueError(
            "generate got an attention_mask that pads some tokens: left-padded batches are "
            "not supported (a padded row's positions differ from the others'); generate "
            "prompts of one length together, or one at a time")
    if refused:
        return options, ValueError(f"commlib's generate does not implement "
                                   f"{', '.join(refused)} (they change the picked tokens); it "
                                   f"does greedy and sampling with temperature, top_k, top_p")
    return options, None


def _input_problem(model, input_ids: torch.Tensor, cache: Optional[ShardedKVCache],
                   options: Dict[str, Any], name: str, comm,
                   prefill_method: str) -> Optional[ValueError]:
    """What is wrong with this call's inputs on this rank (None: nothing)."""
    if name not in LAYOUTS:
        return ValueError(f"prefill {name!r} is not one of commlib's attention "
                          f"implementations ({', '.join(LAYOUTS)})")
    if prefill_method not in ("auto", "pass_q", "pass_kv"):
        return ValueError(f"prefill_method must be 'auto', 'pass_q' or 'pass_kv', got "
                          f"{prefill_method!r}")
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        return ValueError(f"input_ids must be [batch, length] with length >= 1, got shape "
                          f"{tuple(input_ids.shape)}")
    total = input_ids.shape[1] + _new_tokens(options, input_ids.shape[1])
    most = getattr(model.config, "max_position_embeddings", None)
    if most is not None and total > most:
        return ValueError(f"the prompt ({input_ids.shape[1]} tokens) and the new tokens "
                          f"({total - input_ids.shape[1]}) exceed the model's "
                          f"{most} positions (config.max_position_embeddings)")
    if cache is None:
        return None
    if not isinstance(cache, ShardedKVCache):
        return ValueError(f"past_key_values must be the ShardedKVCache a previous generate "
                          f"returned, got {type(cache).__name__}")
    problem = cache.problem(comm.size, comm.rank)
    if problem is not None:
        return problem
    if cache.num_layers != model.config.num_hidden_layers:
        return ValueError(f"the cache holds {cache.num_layers} layers, the model has "
                          f"{model.config.num_hidden_layers}")
    if input_ids.shape[1] <= cache.length or cache.history != _history(
            input_ids[:, :cache.length]):
        return ValueError(f"the cache holds the first {cache.length} tokens of another "
                          f"conversation: input_ids must start with those tokens and add "
                          f"new ones")
    return None


def _history(tokens: torch.Tensor) -> int:
    """A fingerprint of the token ids (the same tokens on every rank)."""
    return zlib.crc32(np.ascontiguousarray(tokens.detach().cpu().numpy()).tobytes()) \
        ^ zlib.crc32(repr(tuple(tokens.shape)).encode())


def _new_tokens(options: Dict[str, Any], prompt: int) -> int:
    """How many tokens to generate: max_new_tokens, else max_length less
    the prompt."""
    if options["max_new_tokens"] is not None:
        return int(options["max_new_tokens"])
    return max(int(options["max_length"]) - prompt, 0)


def _model_layout_name(model: torch.nn.Module) -> str:
    name = getattr(model.config, "_attn_implementation", None)
    return name if name in LAYOUTS else "commlib_ring"


# -- the attention the model runs under ----------------------------------------
@contextlib.contextmanager
def _generation_attention(model: torch.nn.Module, comm, name: str) -> Iterator[None]:
    """The model switched to ``"commlib_generate"`` over ``comm`` (the first
    prefill by ``name``), and back afterwards."""
    attend = implementations(comm)[name]
    AttentionInterface.register(GENERATION, _attention(attend, comm))
    AttentionMaskInterface.register(GENERATION, mask_function(GENERATION, comm))
    previous = model.config._attn_implementation
    model.set_attn_implementation(GENERATION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _attention(attend: Callable, comm) -> Callable:
    """The attention transformers calls per layer during generate: keep the
    step's K and V in the cache, then attend: the first prefill's sharded
    attention, a chunk against the cache, or replicated tokens over it."""

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  dropout: float = 0.0, scaling: Optional[float] = None,
                  is_causal: Optional[bool] = None, sliding_window: Optional[int] = None,
                  **kwargs: Any) -> Tuple[torch.Tensor, None]:
        step = _ACTIVE.get()
        if step is None:
            raise RuntimeError(f"{GENERATION!r} attends only inside "
                               f"commlib.bindings.transformers.generate")
        kwargs.pop("position_ids", None)
        check_call(GENERATION, attention_mask, dropout, kwargs)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window = window_of(GENERATION, sliding_window, step.cache.length, causal)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        keys, values = step.cache.store(module.layer_idx, k, v)
        settings = dict(causal=causal, window=window, softmax_scale=scaling)
        if step.offsets is not None:
            out = attend(q, k, v, cu_seqlens=step.offsets, **settings)
        elif step.replicated:
            out = decode_attention(q, keys, values, comm, q_positions=step.positions,
                                   k_positions=step.cache.positions, **settings)
        else:
            out = chunk_attention(q, keys, values, comm, q_positions=step.positions,
                                  k_positions=step.cache.positions, method=step.method,
                                  **settings)
        return out, None

    attention.__name__ = attention.__qualname__ = GENERATION
    return attention


def _forward(model: torch.nn.Module, step: _Step, keep: torch.Tensor,
             **inputs: Any) -> torch.Tensor:
    """The model on this step's tokens; the logits of the rows ``keep``
    (indices along the sequence) [batch, len(keep), vocab]."""
    token = _ACTIVE.set(step)
    try:
        with torch.no_grad(), (replicated_tokens() if step.replicated
                               else contextlib.nullcontext()):
            return model(use_cache=False, logits_to_keep=keep, **inputs).logits
    finally:
        _ACTIVE.reset(token)


# -- prefill and decode ----------------------------------------------------------
def _prefill(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm, name: str,
             method: str) -> torch.Tensor:
    """The tokens the cache lacks, run through the model into it; returns
    the last position's logits [batch, vocab] (float32), on every rank."""
    start, length = cache.length, input_ids.shape[1]
    if start == 0:
        return _first_prefill(model, input_ids, cache, comm, name)
    new = np.arange(start, length)
    if new.size < comm.size:  # too few to shard: every rank runs them all
        return _replicated(model, input_ids[:, start:], new, cache, comm)
    mine = new[striped(new, comm.size, comm.rank)]
    cache.admit(mine, np.arange(mine.size), length)
    holder = (length - 1) % comm.size
    step = _Step(cache, mine, replicated=False, method=method)
    return _from(comm, _last_logits(model, step, input_ids[:, mine], mine), holder)


def _first_prefill(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm,
                   name: str) -> torch.Tensor:
    """The prompt sharded in ``name``'s layout and attended by it."""
    length = input_ids.shape[1]
    shard = shard_batch({"input_ids": input_ids}, comm, attn_implementation=name)
    offsets = shard["cu_seq_lens_q"].tolist()
    packing = packing_for(offsets, LAYOUTS[name], comm.size, shard["input_ids"].shape[1])
    index = local_index(packing, comm.rank)
    rows = np.flatnonzero(index >= 0)
    cache.admit(index[rows], rows, length)
    cache.prefill = (LAYOUTS[name], length)
    holder = next(r for r in range(comm.size) if (local_index(packing, r) == length - 1).any())
    slot = int(np.flatnonzero(index == length - 1)[0]) if comm.rank == holder else 0
    inputs = {key: shard[key] for key in ("input_ids", "position_ids", "cu_seq_lens_q",
                                          "cu_seq_lens_k", "max_length_q", "max_length_k")}
    logits = _forward(model, _Step(cache, index[rows], replicated=False, offsets=offsets),
                      torch.tensor([slot]), **inputs)
    return _from(comm, logits[:, -1], holder)


def _replicated(model, tokens: torch.Tensor, positions: np.ndarray, cache: ShardedKVCache,
                comm) -> torch.Tensor:
    """``tokens`` [batch, t] at ``positions``, the same on every rank, run
    by every rank; each keeps the K and V of its positions."""
    kept = striped(positions, comm.size, comm.rank)
    cache.admit(positions[kept], kept, int(positions[-1]) + 1)
    step = _Step(cache, positions, replicated=True)
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
            logits: torch.Tensor, sampler: "_Sampler",
            options: Dict[str, Any]) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """New tokens, one a step, as model.generate picks them: a finished row
    (its eos picked) takes the pad token from then on; stop when every row
    is finished or the count is reached."""
    count = _new_tokens(options, input_ids.shape[1])
    eos = options["eos_token_id"]
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = options["pad_token_id"] if options["pad_token_id"] is not None else \
        (eos[0] if eos else None)
    sequences, scores = input_ids, []
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for made in range(count):
        if made:
            position = np.array([sequences.shape[1] - 1])
            logits = _replicated(model, sequences[:, -1:], position, cache, comm)
        scored, picked = sampler.pick(sequences, logits)
        scores.append(scored)
        if pad is not None:
            picked = torch.where(done, torch.full_like(picked, pad), picked)
        sequences = torch.cat([sequences, picked[:, None].to(sequences.dtype)], dim=1)
        if eos:
            done |= torch.isin(picked, torch.tensor(eos, dtype=picked.dtype))
        if bool(done.all()):
            break
    return sequences, scores


class _Sampler:
    """Greedy, or sampling from the processed logits with a generator that
    every rank seeds alike."""

    def __init__(self, options: Dict[str, Any], seed: int, device: torch.device):
        self.sample = bool(options["do_sample"])
        self.warpers: List[Callable] = []
        if self.sample:
            if options["temperature"] != 1.0:
                self.warpers.append(TemperatureLogitsWarper(options["temperature"]))
            if options["top_k"]:
                self.warpers.append(TopKLogitsWarper(options["top_k"]))
            if options["top_p"] < 1.0:
                self.warpers.append(TopPLogitsWarper(options["top_p"]))
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def pick(self, sequences: torch.Tensor,
             logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(the processed scores, the picked token of each row)."""
        for warper in self.warpers:
            logits = warper(sequences, logits)
        if not self.sample:
            return logits, logits.argmax(dim=-1)
        probabilities = torch.softmax(logits, dim=-1)
        return logits, torch.multinomial(probabilities, 1, generator=self.generator)[:, 0]
