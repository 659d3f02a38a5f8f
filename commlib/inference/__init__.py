"""Long-context inference over a context-parallel world: a KV cache sharded
by position, decode attention over it (each rank attends its shard, the
partials merged in one small all-gather), and the prefill of a new chunk
against it (pass-KV or pass-Q, chosen by the bytes each moves)."""

from .attention import PREFILL_METHODS, chunk_attention, decode_attention, prefill_bytes
from .cache import ShardedKVCache, striped
from .latent import latent_chunk_attention, latent_decode_attention, latent_keys

__all__ = ["ShardedKVCache", "striped", "decode_attention", "chunk_attention",
           "prefill_bytes", "PREFILL_METHODS", "latent_decode_attention",
           "latent_chunk_attention", "latent_keys"]
