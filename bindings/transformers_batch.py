"""One rank's shard of a causal-LM batch, with what the model needs to see
the whole sequence: global positions and labels shifted before sharding.

transformers' causal-LM loss shifts the labels by one token and averages
over the tokens it sees. On a shard both would be wrong: the last token of a
shard predicts a token on another rank, and each rank would average over its
own count. So the labels are shifted on the whole sequence, then sharded
(``shift_labels``, which ``ForCausalLMLoss`` takes instead of shifting), and
``num_items_in_batch`` carries the global count of predicted tokens, so that
each rank's loss is its tokens' sum divided by the global count: the losses
of all ranks add up to the global mean, and so do their gradients
(``allreduce_gradients`` sums them).
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from commlib.ring import shard_sequence

__all__ = ["shard_batch"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"
_SHARDED = ("input_ids", "labels", "attention_mask", "position_ids")


def shard_batch(batch: Dict[str, Any], comm, layout: str = "zigzag") -> Dict[str, Any]:
    """This rank's shard of ``batch``, the same global batch on every rank.

    ``batch``: ``input_ids`` [b, s], optionally ``labels`` (default: the
    input ids, as transformers does), ``attention_mask`` (all ones: padding
    is a later commlib issue) and ``position_ids`` (0 .. s-1). The result:
    this rank's ``input_ids`` (and ``attention_mask``), ``position_ids``
    holding the shard's global positions (for RoPE), ``shift_labels`` (the
    labels shifted on the whole sequence, then sharded), ``labels`` (the
    same tensor: the model computes a loss only when given labels, and its
    loss uses ``shift_labels`` when present, never shifting again) and
    ``num_items_in_batch`` (the global count of predicted tokens).

    ``layout`` must be the attention implementation's: ``"zigzag"`` for
    ``commlib_ring``, ``"contiguous"`` for ``commlib_ulysses`` and
    ``commlib_hybrid`` (``transformers_attention.LAYOUTS``). ``s`` must
    divide into 2P (zigzag) or P (contiguous) equal chunks: pad sequences at
    the end, with labels -100 and no attention mask (under the causal mask
    no real token sees the padding).
    """
    unknown = sorted(set(batch) - set(_SHARDED))
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {', '.join(unknown)}; it "
                         f"shards {', '.join(_SHARDED)}")
    input_ids = batch["input_ids"]
    length = input_ids.shape[1]
    positions = torch.arange(length, device=input_ids.device).expand_as(input_ids)
    _check_full_sequences(batch, positions)
    labels = batch.get("labels", input_ids)
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    shard = {"input_ids": shard_sequence(input_ids, comm, layout),
             "position_ids": shard_sequence(positions, comm, layout),
             "shift_labels": shard_sequence(shift_labels, comm, layout),
             "num_items_in_batch": (shift_labels != IGNORE_INDEX).sum()}
    shard["labels"] = shard["shift_labels"]
    if "attention_mask" in batch:
        shard["attention_mask"] = shard_sequence(batch["attention_mask"], comm, layout)
    return shard


def _check_full_sequences(batch: Dict[str, Any], positions: torch.Tensor) -> None:
    """Padding and packed sequences are not implemented: refuse a mask that
    hides tokens, and positions that are not 0 .. s-1."""
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("shard_batch: the attention_mask pads some tokens; commlib attends "
                         "over full sequences only (padding is a later commlib issue)")
    given = batch.get("position_ids")
    if given is not None and not torch.equal(given.expand_as(positions), positions):
        raise ValueError("shard_batch: position_ids other than 0 .. s-1 (packed sequences?) "
                         "are not supported yet (a later commlib issue)")
