"""Encoders on shards (BERT, RoBERTa, ModernBERT, EuroBERT: attention
without the causal mask): what their heads would get silently wrong there.

Attention is the same with or without the causal mask (``_attention``); the
heads are not a causal LM's, whose labels ``_batch`` shifts on the whole
sequence. Which head a model has is transformers' own answer
(``model.loss_type``, from the class name: ``ForMaskedLM``, ...):

- **Per-token heads** (masked LM, token classification): a token's label is
  its own, so the labels are sharded unshifted. Each rank's loss must be its
  labelled tokens' sum over the GLOBAL count (``num_items_in_batch``), so
  that the ranks' losses and gradients add up to the unsharded ones. BERT
  and RoBERTa average over their own tokens instead (``CrossEntropyLoss()``:
  a local mean, NaN on a shard without a masked token), so on a shard the
  model gets no labels and its loss is computed here from its logits.
- **Sequence classification** pools the sequence, which no rank holds:
  BERT's pooler and RoBERTa's head read token 0, ModernBERT and EuroBERT
  the first token or the mean (``POOLINGS``). Where a head pools, the
  sequence is replaced by one token holding the whole sequence's pooled
  value (token 0 from the rank that holds it, or every rank's real tokens'
  sum over the global count), summed over the ranks differentiably; every
  rank then computes the whole batch's logits and loss, and the loss is
  divided by the world size, so that the ranks' losses and gradients add up
  once. A head that pools elsewhere is refused; a pooling inside any other
  module is found by the probe (``_token_mixers``: an output that lost the
  sequence axis), in which these hooks stand for the pooling they make
  exact.
- **RoBERTa-like embeddings** number positions from ``padding_idx + 1``,
  skipping pad tokens, when given none: they get the positions they would
  have made on the whole sequence, sharded; the attention keeps
  ``shard_batch``'s (0, 1, 2, ...).

Other heads (question answering, multiple choice, pre-training's) are
refused by name. The hooks act on the forward of a shard ``shard_batch``
made (recognised by its ``input_ids``); a pooled head refuses any other
forward under commlib's attention.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..torch import SummedOverRanks
from ._attention import LAYOUTS
from ._shard_records import ShardRecords
from ._token_mixers import probing

__all__ = ["EncoderHead", "encoder_head", "POOLINGS"]

IGNORE_INDEX = -100  # transformers' label for "no loss here"
PER_TOKEN = ("ForMaskedLM", "ForTokenClassification")
POOLED = "ForSequenceClassification"
# heads _batch shards as a causal LM's (None: a model without a head, or one transformers
# names otherwise, e.g. BertForPreTraining: the probe refuses what it pools)
CAUSAL = (None, "ForCausalLM", "ForConditionalGeneration")

# Where each sequence-classification head pools (transformers 5): the module, whether the
# sequence pooled is its "input" (it pools it) or its "output" (its caller pools it), and how:
# its "first" token or the "mean" of the real tokens (None: a pooling commlib does not make).
POOLINGS: Dict[str, Callable[[nn.Module], Tuple[nn.Module, str, Optional[str]]]] = {
    "BertForSequenceClassification": lambda m: (m.bert.pooler, "input", "first"),
    "RobertaForSequenceClassification": lambda m: (m.classifier, "input", "first"),
    "ModernBertForSequenceClassification": lambda m: (
        m.model, "output", {"cls": "first", "mean": "mean"}.get(m.config.classifier_pooling)),
    # "late" averages the classifier's per-token logits
    "EuroBertForSequenceClassification": lambda m: (
        m.classifier if m.config.classifier_pooling == "late" else m.model, "output",
        {"bos": "first", "mean": "mean", "late": "mean"}.get(m.config.classifier_pooling)),
}


@dataclass(frozen=True)
class _Shard:
    """What the forward of one encoder shard needs beyond its keyword
    arguments, kept by its ``input_ids``."""

    labels: Optional[torch.Tensor]  # per-token heads: the shard's labels
    num_items: Optional[torch.Tensor]  # and their global count
    real: torch.Tensor  # [s_local] bool: the shard's tokens that are not the layout's padding
    length: int  # real tokens in a row
    first: Optional[int]  # the local index of the sequence's first token, where this rank has it
    positions: Dict[int, torch.Tensor] = field(default_factory=dict)  # by embeddings module id


_shards: ShardRecords[_Shard] = ShardRecords()


@dataclass(frozen=True)
class _HeadHooks:
    """Where the hooks on one model go (compared, to keep them while the
    model stays as it is: the model check's answer depends on them)."""

    kind: str
    pooling: Optional[Tuple[nn.Module, str, str]]
    embeddings: Tuple[nn.Module, ...]
    ranks: int  # one rank holds the whole sequence: the model's own loss and pooling


class EncoderHead:
    """One model's encoder head: its shards' entries, and the hooks that
    make its loss and pooling exact on them (installed at more than one
    rank)."""

    SHARDED = ("token_type_ids",)  # batch keys sharded besides a causal LM's

    def __init__(self, model: nn.Module, comm) -> None:
        self.model, self.comm = model, comm
        self.plan: Optional[_HeadHooks] = None
        self.handles: List[Any] = []
        self.active: Optional[_Shard] = None  # the shard whose forward runs
        self.loss_inputs: Optional[Tuple[torch.Tensor, Any]] = None  # its labels and count

    # ---- the batch --------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return self.plan.kind

    def entries(self, batch: Dict[str, Any], offsets: List[int],
                shard: Callable[[torch.Tensor], torch.Tensor],
                input_ids: torch.Tensor) -> Dict[str, Any]:
        """The shard's entries besides its tokens, positions and documents:
        ``token_type_ids`` sharded; a per-token head's ``labels`` sharded as
        they are (-100 on padding) with ``num_items_in_batch``, their global
        count; a pooled head's ``labels`` (one per row) whole. Remembers the
        shard (``input_ids``, this rank's tokens) for its forward."""
        tokens, labels = batch["input_ids"], batch.get("labels")
        entries: Dict[str, Any] = {}
        if batch.get("token_type_ids") is not None:
            entries["token_type_ids"] = shard(batch["token_type_ids"])
        real = shard(torch.ones_like(tokens[:1])).bool()  # shard_sequence pads with zeros
        count = None
        if self.kind == POOLED:
            if len(offsets) > 2:
                raise ValueError(
                    f"shard_batch: {type(self.model).__name__} pools each row into one answer; "
                    f"{len(offsets) - 1} packed documents in a row would be pooled as one. "
                    f"Give one example per row (no packed position_ids or cu_seq_lens)")
            if labels is not None:
                entries["labels"] = labels
        elif labels is not None:
            if labels.shape != tokens.shape:
                raise ValueError(f"shard_batch: a {self.kind} head's labels are one per token "
                                 f"({tuple(tokens.shape)}, as input_ids), not "
                                 f"{tuple(labels.shape)}")
            count = (labels != IGNORE_INDEX).sum()
            entries.update(labels=torch.where(real.expand_as(input_ids), shard(labels),
                                              IGNORE_INDEX),
                           num_items_in_batch=count)
        first = (shard(torch.arange(1, tokens.shape[1] + 1).unsqueeze(0))[0] == 1).nonzero()
        positions = {} if batch.get("position_ids") is not None else {
            id(module): shard(module.create_position_ids_from_input_ids(tokens, module.padding_idx))
            for module in self.plan.embeddings}
        _shards.keep(input_ids, _Shard(entries.get("labels"), count, real[0], offsets[-1],
                                       int(first[0, 0]) if len(first) else None, positions))
        return entries

    # ---- the hooks ---------------------------------------------------------------------------
    def install(self, plan: _HeadHooks) -> None:
        """The hooks for ``plan``, kept while it is the same (new handles
        would make the model look changed to its check)."""
        if plan == self.plan:
            return
        for handle in self.handles:
            handle.remove()
        self.plan, self.handles = plan, []
        if plan.ranks == 1:
            return
        self.handles = [
            self.model.register_forward_pre_hook(self._before, with_kwargs=True),
            self.model.register_forward_hook(self._after, with_kwargs=True, always_call=True)]
        if plan.pooling is not None:
            module, where, _ = plan.pooling
            self.handles.append(module.register_forward_pre_hook(self._pool_input)
                                if where == "input" else
                                module.register_forward_hook(self._pool_output))
        self.handles += [module.register_forward_pre_hook(self._embed, with_kwargs=True)
                         for module in plan.embeddings]

    def _before(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """Recognise the shard; take a per-token head's labels from the
        model (its own loss would be a local mean). The ranks agree on the
        verdict."""
        if probing() or model.config._attn_implementation not in LAYOUTS:
            return None  # the probe's run, or the whole sequence: no commlib in it
        shard = _shards.of(kwargs.get("input_ids", args[0] if args else None))
        problem = None
        try:
            kwargs = self._taken(model, shard, kwargs)
        except ValueError as error:
            problem = error
        self.comm.agree("transformers encoder forward", problem=problem)
        self.active = shard
        return args, kwargs

    def _taken(self, model: nn.Module, shard: Optional[_Shard], kwargs: Dict[str, Any]
               ) -> Dict[str, Any]:
        name = type(model).__name__
        if self.kind == POOLED:
            if shard is None:
                raise ValueError(
                    f"{name} pools the sequence, which on shards needs the shard shard_batch "
                    f"made (it tells which rank holds the first token, which tokens are "
                    f"padding): make the batch with shard_batch(batch, comm, "
                    f"attn_implementation=model)")
            return kwargs
        labels = kwargs.get("labels")
        if labels is None:
            return kwargs
        count = kwargs.get("num_items_in_batch")
        if count is None:
            if shard is None or labels is not shard.labels:
                raise ValueError(
                    f"{name} got labels on a shard without num_items_in_batch: its loss would "
                    f"average over this rank's tokens only. Pass the shard as shard_batch made "
                    f"it (model(**shard)), or the global count of labelled tokens as "
                    f"num_items_in_batch")
            count = shard.num_items
        self.loss_inputs = (labels, count)
        return {key: value for key, value in kwargs.items() if key != "labels"}

    def _after(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
               output: Any) -> Any:
        """This rank's share of the loss: a per-token head's labelled
        tokens' sum over the global count; a pooled head's whole loss over
        the world size."""
        loss_inputs, self.loss_inputs, self.active = self.loss_inputs, None, None
        if output is None or (loss_inputs is None and self.kind != POOLED):
            return None  # the forward raised, or nothing to do
        if not isinstance(output, ModelOutput):
            raise ValueError(f"{type(model).__name__} on shards returns a ModelOutput (its loss "
                             f"is completed there), not {type(output).__name__}: leave "
                             f"return_dict at True")
        if loss_inputs is not None:
            return type(output)(**{**output, "loss": _share(output.logits, *loss_inputs)})
        if output.get("loss") is not None:
            return type(output)(**{**output, "loss": output.loss / self.comm.size})
        return None

    def _pool_input(self, module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        return (self._pooled(args[0]), *args[1:])

    def _pool_output(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self._pooled(output)
        key = next(iter(output.keys()))  # a ModelOutput: the sequence comes first
        output[key] = self._pooled(output[key])
        return output

    def _pooled(self, sequence: torch.Tensor) -> torch.Tensor:
        """[b, s_local, ...] -> [b, 1, ...], the whole sequence's pooled
        token on every rank (differentiable: the gradient of every rank's
        share reaches the tokens it came from). In the probe, zeros: the
        pooling is made exact here, so the probe must not find it."""
        pooled_shape = (sequence.shape[0], 1, *sequence.shape[2:])
        if probing():
            return sequence.new_zeros(pooled_shape)
        shard = self.active
        if shard is None:
            return sequence  # not a shard's forward (refused before under commlib's attention)
        if self.plan.pooling[2] == "first":
            # times 0 elsewhere: every rank's backward reaches its attention (a collective)
            held = shard.first is not None
            local = sequence[:, shard.first or 0:(shard.first or 0) + 1] * float(held)
        else:
            real = shard.real.to(sequence.device, sequence.dtype)
            weights = real.view(1, -1, *(1,) * (sequence.dim() - 2)) / shard.length
            local = (sequence * weights).sum(dim=1, keepdim=True)
        return SummedOverRanks.apply(local, self.comm)

    def _embed(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
               ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        positions = None if self.active is None else self.active.positions.get(id(module))
        return None if positions is None else (args, {**kwargs, "position_ids": positions})


def _share(logits: torch.Tensor, labels: torch.Tensor, count: Any) -> torch.Tensor:
    """The labelled tokens' cross-entropy summed over the global ``count``
    (in float32 at least, as transformers' ``ForMaskedLMLoss``)."""
    if tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"logits {tuple(logits.shape)} do not match the labels "
                         f"{tuple(labels.shape)} token for token")
    wide = torch.promote_types(logits.dtype, torch.float32)
    total = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(wide),
                                        labels.reshape(-1).to(logits.device),
                                        ignore_index=IGNORE_INDEX, reduction="sum")
    return total / torch.as_tensor(count, device=total.device)


_heads: "weakref.WeakKeyDictionary[nn.Module, EncoderHead]" = weakref.WeakKeyDictionary()


def encoder_head(model: nn.Module, comm) -> Optional[EncoderHead]:
    """``model``'s encoder head with its hooks in place (before the model
    check, which sees them), or None for a causal LM's (``_batch`` shards
    those). Refuses, by name, a head whose loss or pooling a shard would get
    wrong (the same model on every rank: every rank raises)."""
    model = getattr(model, "_orig_mod", model)
    kind, name = getattr(model, "loss_type", None), type(model).__name__
    if kind in CAUSAL:
        return None
    if kind not in PER_TOKEN and kind != POOLED:
        raise ValueError(
            f"shard_batch does not shard batches for {name} (a {kind} head: its loss reads "
            f"the sequence as a whole, which no rank holds); it shards causal-LM, masked-LM, "
            f"token-classification and sequence-classification batches")
    pooling = None
    if kind == POOLED:
        pooling = POOLINGS[name](model) if name in POOLINGS else None
        if pooling is None or pooling[2] is None:
            how = "" if pooling is None else \
                f" (classifier_pooling={model.config.classifier_pooling!r})"
            raise ValueError(
                f"{name} pools the sequence{how} in a way commlib does not make exact on "
                f"shards (each rank would pool its own tokens: silently wrong); it pools "
                f"{', '.join(sorted(POOLINGS))} (the first token or the mean). Run this "
                f"model unsharded")
    head = _heads.get(model)
    if head is None:
        head = _heads[model] = EncoderHead(model, comm)
    head.comm = comm  # a later register(comm) replaces the communicator
    head.install(_HeadHooks(kind, pooling, tuple(
        module for module in model.modules()
        if callable(getattr(module, "create_position_ids_from_input_ids", None))
        and isinstance(getattr(module, "padding_idx", None), int)), comm.size))
    return head
