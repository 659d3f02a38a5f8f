"""One rank's shard of a causal-LM batch, with what the model needs to see
the whole sequence: global positions, labels shifted before sharding, and
the packed documents' offsets.

transformers' causal-LM loss shifts the labels by one token and averages
over the tokens it sees. On a shard both would be wrong: the last token of a
shard predicts a token on another rank, and each rank would average over its
own count. So the labels are shifted on the whole sequence, then sharded
(``shift_labels``, which ``ForCausalLMLoss`` takes instead of shifting), and
``num_items_in_batch`` carries the global count of predicted tokens, so that
each rank's loss is its tokens' sum divided by the global count: the losses
of all ranks add up to the global mean, and so do their gradients
(``allreduce_gradients`` sums them).

Packed sequences (``DataCollatorWithFlattening``: one row, position ids
restarting at 0 per document) and sequences of any length travel as the
global document offsets ``cu_seq_lens_q``/``cu_seq_lens_k``: the sequence is
padded where the layout needs it, and the attention reads the documents and
the padding from the offsets, which the model forwards to every attention
call.
"""

from __future__ import annotations

import reprlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from commlib.ring import shard_sequence
from commlib.sequence.documents import as_offsets, cu_seqlens_from_position_ids

from ._attention import layout_of
from ._encoders import EncoderHead, encoder_head
from ._model_check import check_model
from ._sharded_forward import guard, remember
from ._token_mixers import structure

__all__ = ["shard_batch", "sharded_batch"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"
_SHARDED = ("input_ids", "labels", "attention_mask", "position_ids")
# what DataCollatorWithFlattening(return_flash_attn_kwargs=True) adds, and TRL's padding-free
# collator's seq_idx (each token's document): checked, then remade
_DOCUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def shard_batch(batch: Dict[str, Any], comm, *,
                attn_implementation: torch.nn.Module) -> Dict[str, Any]:
    """This rank's shard of ``batch``, the same global batch on every rank,
    for the model ``attn_implementation`` (collective): in the sequence
    layout of its ``config._attn_implementation`` (one of commlib's,
    ``LAYOUTS``), after checking that every layer of it that mixes tokens
    along the sequence is context-parallel (``check_model``: commlib's
    attention, recurrent mixers made parallel by ``recurrent_parallel``);
    any other is refused on every rank, naming it. A name instead of the
    model is refused: nothing could check the model. The attention and the
    recurrent mixers check the shard's ``position_ids`` against their own
    layout, so a batch sharded for another implementation raises instead of
    attending over the wrong tokens.

    ``batch``: ``input_ids`` [b, s] (any s), optionally ``labels`` (default:
    the input ids, as transformers does), ``attention_mask`` (all ones, or
    a causal LM's right padding with labels -100 there; other padding is
    refused) and ``position_ids``: 0 .. s-1, or, for
    documents packed into the sequence, restarting at 0 at every document
    and counting 0, 1, 2, ... within it (every row packed alike), as
    ``DataCollatorWithFlattening`` makes them (its ``cu_seq_lens_*`` and
    ``max_length_*`` are accepted when they agree). The result:

    - ``input_ids``: this rank's tokens in ``layout``, padded where the
      layout needs it (``commlib.ring.shard_sequence``);
    - ``position_ids``: the shard's positions in the global sequence (in
      its document when packed), for RoPE;
    - ``shift_labels``: the labels shifted on the whole sequence, then
      sharded (-100 on padding); ``labels``: the same tensor (the model
      computes a loss only when given labels, and its loss uses
      ``shift_labels`` when present, never shifting again);
    - ``num_items_in_batch``: the global count of predicted tokens;
    - ``cu_seq_lens_q``/``cu_seq_lens_k``: the documents' GLOBAL offsets
      (int32, on the host: commlib reads them there; ``[0, s]`` unpacked),
      which tell the attention the documents and the padding;
      ``max_length_q``/``max_length_k``: the longest document.

    That is a causal LM's shard (``model.loss_type`` ForCausalLM, or none).
    An encoder's masked-LM, token- or sequence-classification head gets
    ``token_type_ids`` sharded and its own ``labels`` instead, and hooks
    that make its loss and pooling exact (``_encoders``); other heads are
    refused.

    The ``attention_mask`` is dropped: all ones it carries nothing, a right
    padding nothing a causal attention reads (its labels become -100), and a
    sharded one would mark the layout's padding. The shard's forward is
    checked (``_sharded_forward``): the model must be as checked, and
    ``labels`` given without ``shift_labels`` are completed when they are
    the shard's own, refused otherwise.
    """
    model = attn_implementation
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"shard_batch needs the model (attn_implementation=model), not "
                         f"{model!r}: it checks that every layer of the model that mixes "
                         f"tokens along the sequence runs on shards; a name says nothing of "
                         f"the model's other layers (docs/transformers.md)")
    guarded = guard(model, comm) if comm.size > 1 else None
    encoder = encoder_head(model, comm)  # None: a causal LM's batch
    offsets = _checked_documents(batch, () if encoder is None else EncoderHead.SHARDED)
    check_model(model, comm, before="shard_batch", training=True, longest=_longest(offsets))
    if guarded is not None:
        guarded.checked = structure(getattr(model, "_orig_mod", model))
    return remember(_shard(batch, offsets, comm, layout_of(model), encoder))


def sharded_batch(batch: Dict[str, Any], comm, *, layout: str) -> Dict[str, Any]:
    """``shard_batch``'s shard in ``layout``, for a model already checked
    (generate's prefill)."""
    return _shard(batch, _checked_documents(batch), comm, layout)


def _checked_documents(batch: Dict[str, Any], also: Tuple[str, ...] = ()) -> List[int]:
    """The batch's documents' global offsets, after refusing what
    ``shard_batch`` does not shard (``also``: an encoder's keys besides; the
    same batch on every rank: every rank raises alike)."""
    sharded = (*_SHARDED, *also)
    unknown = sorted(set(batch) - set(sharded) - set(_DOCUMENTS))
    if unknown:
        raise ValueError(f"shard_batch does not know how to shard {', '.join(unknown)}; it "
                         f"shards {', '.join(sharded)} (and checks {', '.join(_DOCUMENTS)})")
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()) and (also or not _right_padding(batch)):
        raise ValueError("shard_batch: the attention_mask pads some tokens in a way it does not "
                         "implement (it takes a causal LM's right padding, labels -100 there, "
                         "as DataCollatorForLanguageModeling makes them): pad on the right, or "
                         "pack the sequences instead (position_ids restarting at 0 per "
                         "document, as DataCollatorWithFlattening makes them)")
    offsets = _offsets(batch, batch["input_ids"].shape[1])
    _check_sequence_index(batch.get("seq_idx"), offsets)
    return offsets


def _right_padding(batch: Dict[str, Any]) -> bool:
    """A causal LM's right padding, unpacked: every row's mask ones then
    zeros, labels (if given) -100 where it is zero. Causal attention never
    lets a real token read a later pad, so the batch is exact unpadded, its
    padding's labels -100."""
    mask = batch["attention_mask"].bool()
    labels = batch.get("labels")
    return (batch.get("position_ids") is None and batch.get("cu_seq_lens_q") is None
            and bool((mask[:, 1:] <= mask[:, :-1]).all())
            and (labels is None or bool((labels[~mask] == IGNORE_INDEX).all())))


def _check_sequence_index(seq_idx: Any, offsets: List[int]) -> None:
    """TRL's ``seq_idx`` (each token's document) must name the documents
    the offsets say (the attention reads the offsets; it would refuse
    seq_idx itself)."""
    if seq_idx is None:
        return
    lengths = torch.tensor(offsets).diff()
    want = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    given = torch.as_tensor(seq_idx).cpu()
    if not torch.equal(given.reshape(-1, want.numel()) - given.reshape(-1)[:1],
                       want.expand(given.reshape(-1, want.numel()).shape)):
        raise ValueError(f"shard_batch: seq_idx does not number the documents of the "
                         f"position_ids (offsets {reprlib.repr(offsets)})")


def _longest(offsets: List[int]) -> int:
    return max(stop - start for start, stop in zip(offsets, offsets[1:]))


def _shard(batch: Dict[str, Any], offsets: List[int], comm, layout: str,
           encoder: Optional[EncoderHead] = None) -> Dict[str, Any]:
    input_ids = batch["input_ids"]
    positions = _positions(batch, offsets, input_ids)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, comm, layout=layout, cu_seqlens=offsets)

    cu_seq_lens = torch.tensor(offsets, dtype=torch.int32)
    longest = _longest(offsets)
    tokens = shard(input_ids)
    common = {"input_ids": tokens, "position_ids": shard(positions),
              "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
              "max_length_q": longest, "max_length_k": longest}
    if encoder is not None:  # its labels are not shifted, or not per token
        return {**common, **encoder.entries(batch, offsets, shard, tokens)}
    labels = batch.get("labels", input_ids)
    if batch.get("attention_mask") is not None:  # right padding: no loss there
        labels = torch.where(batch["attention_mask"].bool(), labels, IGNORE_INDEX)
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    real = shard(torch.ones_like(shift_labels)).bool()  # shard_sequence pads with zeros
    shard_labels = torch.where(real, shard(shift_labels), IGNORE_INDEX)
    return {**common, "shift_labels": shard_labels, "labels": shard_labels,
            "num_items_in_batch": (shift_labels != IGNORE_INDEX).sum()}


def _offsets(batch: Dict[str, Any], length: int) -> List[int]:
    """The documents' global offsets: where the position ids restart at 0,
    else the collator's ``cu_seq_lens_q``, else one document; any
    ``cu_seq_lens_q``/``_k`` given must agree (a batch assembled from
    different sources would otherwise attend across its documents)."""
    try:
        given = batch.get("position_ids")
        source = (batch.get("cu_seq_lens_q") if given is None
                  else cu_seqlens_from_position_ids(given))
        offsets = [0, length] if source is None else list(
            as_offsets(torch.as_tensor(source).cpu(), length))
    except ValueError as error:
        raise ValueError(f"shard_batch: {error}") from None
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        stated = None if batch.get(key) is None else torch.as_tensor(batch[key]).tolist()
        if stated is not None and stated != offsets:
            raise ValueError(f"shard_batch: {key} {reprlib.repr(stated)} disagrees with the "
                             f"documents {reprlib.repr(offsets)} (from the "
                             f"position_ids, else cu_seq_lens_q)")
    return offsets


def _positions(batch: Dict[str, Any], offsets: List[int],
               input_ids: torch.Tensor) -> torch.Tensor:
    """Every token's position in its document ([b, s]). Given position ids
    must be exactly these: anything else (left padding, positions that skip
    or do not start at 0) would rotate RoPE differently from the documents
    the attention sees."""
    starts = torch.tensor(offsets[:-1], device=input_ids.device)
    lengths = torch.tensor(offsets, device=input_ids.device).diff()
    positions = (torch.arange(offsets[-1], device=input_ids.device)
                 - starts.repeat_interleave(lengths)).expand_as(input_ids)
    given = batch.get("position_ids")
    if given is not None and not torch.equal(given.expand_as(positions), positions):
        raise ValueError("shard_batch: position_ids must count 0, 1, 2, ... within every "
                         "document, restarting at 0 where a packed document starts (as "
                         "DataCollatorWithFlattening makes them); these do not (left padding? "
                         "a skipped position?)")
    return positions
