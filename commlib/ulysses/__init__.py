"""Ulysses sequence parallelism: an all-to-all swaps a sequence-sharded
layout [b, s/P, h, d] for a head-sharded one [b, s, h/P, d], attention runs
locally over the whole sequence, and a second all-to-all swaps back."""

from .attention import ulysses_attention, ulysses_attention_backward
from .overlap import ulysses_attention_overlapped
from .relayout import head_to_seq, seq_to_head, seq_to_head_many

__all__ = ["seq_to_head", "head_to_seq", "seq_to_head_many", "ulysses_attention",
           "ulysses_attention_backward", "ulysses_attention_overlapped"]
