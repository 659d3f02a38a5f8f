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

Multi-head latent attention layers (DeepSeek-V2/V3, ...) cache their latent
and rotary key, not expanded heads: the first prefill moves the latent
around the ring, decode and later chunks attend in the absorbed form
(``_generation_attention._latent_attention``, ``commlib.inference.latent``).

With ``compile_decode=True`` the decode step (the model on one token) is
``torch.compile(fullgraph=True)``'d once: the cache's new tokens go to a
``bindings.torch._inference.DecodeCache`` (fixed buffers, positions and
count on the device), so no step changes a shape or reads the device, and
the step compiles once for the whole call; the tokens are eager's
(``_generation_attention.CompiledDecode``).

The cache keeps a layer per attention call of a forward, in the order
the forward makes them (``_generation_attention.ForwardStep.slot``): a
layer that attends twice (DiffLlama's two softmaxes over the same keys) or
a module that serves several layers (HRM-text's stacks, run in cycles) gets
a cache layer per call, which transformers' ``layer_idx`` would not give it.

The model runs under an attention implementation of its own for the call
(``"commlib_generate"``, ``_generation_attention``); its configured one is
restored afterwards. What generate refuses, and why, is
``_generation_checks``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from transformers.generation import GenerateDecoderOnlyOutput, LogitsProcessorList

from commlib.inference import ShardedKVCache, striped
from commlib.sequence.documents import local_index, packing_for

from ._attention import LAYOUTS
from ._batch import sharded_batch
from ._expert_rebalance import Rebalancer
from ._generation_attention import CompiledDecode, ForwardStep, forward_step, generation_attention
from ._generation_checks import (
    GenerationPlan,
    compile_problem,
    input_problem,
    plan_generation,
    rebalance_problem,
    recurrent_states_of,
    token_history,
)
from ._recurrent import has_parallel_recurrent_layers
from ._recurrent_generation import recurrent_states

__all__ = ["generate"]


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
    plan, problem = plan_generation(model, input_ids, generate_kwargs)
    if problem is None:
        problem = input_problem(model, input_ids, past_key_values, plan, name, comm,
                                prefill_method, compile_decode) or \
            rebalance_problem(model, rebalance_every, redundant_experts, compile_decode)
    comm.agree("transformers.generate", tuple(input_ids.shape), token_history(input_ids),
               None if plan is None else plan.digest, seed, name, prefill_method,
               None if past_key_values is None else past_key_values.digest(),
               bool(compile_decode), rebalance_every, redundant_experts, problem=problem)
    cache = past_key_values
    sampler = _Sampler(plan.processors, _generator(plan, seed, comm, input_ids.device))
    rebalancer = None if rebalance_every is None else \
        Rebalancer(model, comm, rebalance_every, redundant_experts)
    with generation_attention(model, comm, name) as decoding:
        if cache is None:
            logits, cache = _first_prefill(model, input_ids, comm, name)
        else:
            logits = _prefill(model, input_ids, cache, comm, prefill_method)
        unrolled = compile_problem(cache.callers) if compile_decode else None
        if unrolled is not None:  # known once a forward ran; the same on every rank
            raise unrolled
        stepper = CompiledDecode(model, cache, comm, decoding, plan.max_length,
                                 input_ids.shape[0], input_ids.device) \
            if compile_decode else None
        sequences, scores = _decode(model, input_ids, cache, comm, logits, sampler, plan,
                                    stepper, rebalancer)
    cache.history = token_history(sequences[:, :cache.length])
    if not plan.config.return_dict_in_generate:
        return sequences
    fields = GenerateDecoderOnlyOutput.__dataclass_fields__
    return GenerateDecoderOnlyOutput(
        sequences=sequences, scores=tuple(scores) if plan.config.output_scores else None,
        **{"cache" if "cache" in fields else "past_key_values": cache})


def _model_layout_name(model: torch.nn.Module) -> str:
    name = getattr(model.config, "_attn_implementation", None)
    return name if name in LAYOUTS else "commlib_ring"


# -- prefill and decode ----------------------------------------------------------
def _prefill(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm,
             method: str) -> torch.Tensor:
    """The tokens ``cache`` (of an earlier turn) lacks, run through the
    model into it; returns the last position's logits [batch, vocab]
    (float32), on every rank."""
    start, length = cache.length, input_ids.shape[1]
    new = np.arange(start, length)
    # too few to shard, or a recurrence to read in order: every rank runs them all
    if new.size < comm.size or recurrent_states_of(cache) is not None:
        return _replicated(model, input_ids[:, start:], new, cache, comm)
    mine = new[striped(new, comm.size, comm.rank)]
    cache.admit(mine, np.arange(mine.size), length)
    holder = (length - 1) % comm.size
    step = ForwardStep(cache, mine, replicated=False, method=method)
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
    step = ForwardStep(None, index[rows], replicated=False, offsets=offsets,
                       layout=LAYOUTS[name], states=states)
    logits = forward_step(model, step, torch.tensor([last]), **inputs)
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
    step = ForwardStep(cache, positions, replicated=True, states=recurrent_states_of(cache))
    return _last_logits(model, step, tokens, positions).float()


def _last_logits(model, step: ForwardStep, tokens: torch.Tensor,
                 positions: np.ndarray) -> torch.Tensor:
    """The model on ``tokens`` [batch, t] at global ``positions``: the last
    token's logits [batch, vocab]."""
    position_ids = torch.as_tensor(positions)[None].expand(tokens.shape[0], -1)
    logits = forward_step(model, step, torch.tensor([positions.size - 1]), input_ids=tokens,
                      position_ids=position_ids)
    return logits[:, -1]


def _from(comm, logits: torch.Tensor, holder: int) -> torch.Tensor:
    """``holder``'s logits [batch, vocab] on every rank (float32)."""
    return comm.bcast(logits.float().contiguous(), root=holder)


def _decode(model, input_ids: torch.Tensor, cache: ShardedKVCache, comm,
            logits: torch.Tensor, sampler: "_Sampler", plan: GenerationPlan,
            stepper: Optional[CompiledDecode] = None,
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


def _generator(plan: GenerationPlan, seed: Optional[int], comm,
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
