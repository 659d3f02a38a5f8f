"""The sequence geometry every context-parallel method shares: how a
sequence is cut into shards (``layout``: ``shard_sequence``,
``unshard_sequence``), packed documents and padding (``documents``), which
(query, key) blocks a call computes (``visibility``), any mask as slices
(``masks``, ``common_masks``), the mask-balanced placement (``balanced``),
and one attention call's facts, checked and agreed once
(``attention_call``). Ring, Ulysses, the hybrid, inference, the recurrent
layers and the bindings all read it; it reads none of them."""

from .layout import LAYOUTS, MASK_LAYOUTS, shard_sequence, unshard_sequence

__all__ = ["shard_sequence", "unshard_sequence", "LAYOUTS", "MASK_LAYOUTS"]
