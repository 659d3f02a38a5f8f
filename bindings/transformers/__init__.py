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
Mamba2) and
``allreduce_gradients(model, comm)`` after ``backward()``. The pieces:
``transformers_attention.py`` (the attention implementations and their
mask functions), ``transformers_batch.py`` (sharding a batch, packed or
not: global positions, labels and document offsets),
``transformers_experts.py`` (experts over the torch ``Dispatcher``),
``transformers_recurrent.py`` (recurrent mixers on shards),
``transformers_gradients.py`` (summing the gradients of replicated
parameters), ``transformers_generate.py`` (``generate``: sharded prefill,
decode over a KV cache sharded by position).
"""

from __future__ import annotations

from typing import Optional

from .transformers_attention import LAYOUTS, register_attention
from .transformers_batch import shard_batch
from .transformers_experts import expert_parallel, register_experts
from .transformers_generate import GENERATION, generate
from .transformers_gradients import allreduce_gradients
from .transformers_recurrent import recurrent_parallel

__all__ = ["register", "shard_batch", "expert_parallel", "recurrent_parallel",
           "allreduce_gradients", "generate", "GENERATION", "LAYOUTS"]


def register(comm, ulysses_size: Optional[int] = None) -> None:
    """Register ``"commlib_ring"``, ``"commlib_ring_docs"``,
    ``"commlib_ulysses"`` and ``"commlib_hybrid"`` (attention, with their
    mask functions) and ``"commlib_ep"`` (experts) over ``comm`` in
    transformers' registries.
    ``ulysses_size``: the hybrid's Ulysses degree (default: ``hybrid.plan``'s
    choice). A later call replaces the communicator."""
    register_attention(comm, ulysses_size=ulysses_size)
    register_experts()
