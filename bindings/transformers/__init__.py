"""Hugging Face transformers over commlib: context-parallel attention and
expert-parallel MoE in unmodified transformers models, through
transformers' own registries (``AttentionInterface``,
``AttentionMaskInterface``, ``ExpertsInterface``).

Three lines::

    commlib.bindings.transformers.register(comm)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="commlib_ring")
    batch = commlib.bindings.transformers.shard_batch(batch, comm, attn_implementation=model)

then ``expert_parallel(model, comm)`` for MoE models,
``recurrent_parallel(model, comm)`` for hybrid models (Gated DeltaNet,
Mamba2, LFM2's short convolutions) and ``allreduce_gradients(model, comm)``
after ``backward()``; ``generate`` for inference. A file per concept, all
private (this ``__all__`` is the API): ``_attention.py`` (the attention
implementations and their mask functions), ``_batch.py`` (sharding a batch,
packed or not: global positions, labels and document offsets),
``_encoders.py`` (encoders' heads on shards: masked-LM loss, pooling),
``_token_mixers.py`` and ``_model_check.py`` (which layers mix tokens,
found by running the model; whether it may take a sharded batch),
``_experts.py`` (experts over the torch ``Dispatcher``), ``_recurrent.py``
and ``_recurrent_generation.py`` (recurrent mixers on shards; their states
in generate), ``_gradients.py`` (summing the gradients of replicated
parameters), ``_generate.py`` (``generate``: sharded prefill, decode over
a KV cache sharded by position), ``_generation_checks.py`` (what generate
refuses, and why), ``_generation_attention.py`` (the attention generate runs
the model under; the compiled decode step).
"""

from __future__ import annotations

from typing import Optional

from ._attention import LAYOUTS, mark_checked, register_attention
from ._batch import shard_batch
from ._batch import (
    sharded_batch as sharded_batch,  # the batch without the model check (benchmarks of a layer)
)
from ._experts import expert_parallel, register_experts
from ._generate import generate
from ._generation_attention import GENERATION
from ._gradients import allreduce_gradients
from ._recurrent import recurrent_parallel
from ._trainer import prepare_trainer

__all__ = ["register", "shard_batch", "expert_parallel", "recurrent_parallel",
           "allreduce_gradients", "generate", "prepare_trainer", "mark_checked", "GENERATION",
           "LAYOUTS"]


def register(comm, ulysses_size: Optional[int] = None) -> None:
    """Register ``"commlib_ring"``, ``"commlib_ring_docs"``,
    ``"commlib_ulysses"`` and ``"commlib_hybrid"`` (attention, with their
    mask functions) and ``"commlib_ep"`` (experts) over ``comm`` in
    transformers' registries.
    ``ulysses_size``: the hybrid's Ulysses degree (default: ``hybrid.plan``'s
    choice). A later call replaces the communicator."""
    register_attention(comm, ulysses_size=ulysses_size)
    register_experts()
