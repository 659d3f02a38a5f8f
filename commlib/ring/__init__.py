"""Ring Attention: the sequence sharded over ranks, K/V rotated around a
ring, partial results merged with the online softmax. Tensors are
[batch, seq, heads, head_dim]."""

from ..kernels.merge import merge
from ..kernels.tiled import attention_backward, attention_forward
from ..sequence.layout import LAYOUTS, MASK_LAYOUTS, shard_sequence, unshard_sequence
from .attention import METHODS, ring_attention, ring_attention_backward
from .exchange import RingExchange
from .latent import LATENT_METHODS, latent_ring_attention, latent_ring_attention_backward

__all__ = ["ring_attention", "ring_attention_backward", "RingExchange", "merge",
           "shard_sequence", "unshard_sequence", "attention_forward", "attention_backward",
           "LAYOUTS", "MASK_LAYOUTS", "METHODS", "latent_ring_attention",
           "latent_ring_attention_backward", "LATENT_METHODS"]
