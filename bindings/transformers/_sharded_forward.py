"""A forward of a ``shard_batch`` shard, checked where it reaches the model.

A shard carries no mark of what it was cut for, and two mistakes run
without a word: the model changed after ``shard_batch`` checked it (its
attention switched to one that is not commlib's, which then attends within
each shard; a hook or a swapped class that mixes tokens), or the loss given
the shard's ``labels`` alone, which transformers shifts again inside each
shard (every shard's last token would predict its own first). So
``shard_batch`` remembers the tensors it hands out, and a forward pre-hook
on the model it checked, on meeting one of them, refuses a model changed
since (naming the change) and completes a causal-LM loss: ``labels`` that
are the shard's labels or its ``input_ids`` (as an unsharded script writes
it) get the ``shift_labels`` made on the whole sequence, and the global
``num_items_in_batch`` where none is given. Any other ``labels`` without
``shift_labels`` is refused. The ranks agree on the verdict, so all raise
together.

Under ``torch.compile`` the hook stands aside when traced (a compiled step
trusts ``shard_batch``), but runs eagerly when ``shard_batch`` was given the
compiled module itself: its hooks run outside the compiled graph.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ._attention import LAYOUTS
from ._shard_records import ShardRecords
from ._token_mixers import Structure, structure, what_changed

__all__ = ["guard", "remember"]


@dataclass(frozen=True)
class _Shard:
    """What ``shard_batch`` made alongside a shard's ``input_ids``."""

    labels: Optional[torch.Tensor]
    shift_labels: Optional[torch.Tensor]
    num_items_in_batch: Optional[torch.Tensor]


_shards: ShardRecords[_Shard] = ShardRecords()


def remember(shard: Dict[str, Any]) -> Dict[str, Any]:
    """Remember what ``shard`` holds, so that its forward can be checked;
    returns ``shard``."""
    _shards.keep(shard["input_ids"], _Shard(shard.get("labels"), shard.get("shift_labels"),
                                            shard.get("num_items_in_batch")))
    return shard


class _Guard:
    """The pre-hook on a model ``shard_batch`` checked; ``checked`` is its
    structure at the last check."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.checked: Optional[Structure] = None

    def __call__(self, model: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                 ) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        if torch.compiler.is_compiling():
            return None
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        shard = _shards.of(input_ids)
        if shard is None:
            return None  # not a shard: a forward of the whole sequence, generate's
        problem = None
        try:
            kwargs = self._completed(model, shard, input_ids, kwargs)
        except ValueError as error:
            problem = error
        self.comm.agree("transformers forward of a shard_batch shard", problem=problem)
        return args, kwargs

    def _completed(self, model: nn.Module, shard: _Shard, input_ids: torch.Tensor,
                   kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """``kwargs`` with the loss's inputs completed, after refusing a model
        changed since its check and labels that would be shifted again."""
        inner = getattr(model, "_orig_mod", model)
        changed = None if self.checked is None else what_changed(inner, self.checked)
        if changed is not None:
            implementation = structure(inner).implementation
            fix = (f"set it back (model.set_attn_implementation({self.checked.implementation!r}))"
                   if implementation not in LAYOUTS else
                   "call shard_batch(batch, comm, attn_implementation=model) again after "
                   "changing the model: it checks the change")
            raise ValueError(f"{type(inner).__name__} changed since shard_batch checked it "
                             f"({changed}): nothing checked that the layers that mix tokens "
                             f"still see the whole sequence on its shards; {fix}")
        labels = kwargs.get("labels")
        if labels is None or shard.shift_labels is None:
            return kwargs
        given_shift = kwargs.get("shift_labels")
        if given_shift is None:
            if labels is not shard.labels and labels is not input_ids:
                raise ValueError(
                    "labels given without shift_labels for a shard_batch shard: transformers "
                    "would shift them inside each shard, so every shard's last token would "
                    "predict its own first. Pass the shard as shard_batch made it "
                    "(model(**shard)), or labels=shard['labels'] or shard['input_ids'] (their "
                    "shift_labels are filled in), or put your labels in the global batch "
                    "before shard_batch (batch['labels'])")
            kwargs = {**kwargs, "labels": shard.shift_labels, "shift_labels": shard.shift_labels}
            given_shift = shard.shift_labels
        if given_shift is shard.shift_labels and kwargs.get("num_items_in_batch") is None:
            kwargs = {**kwargs, "num_items_in_batch": shard.num_items_in_batch}
        return kwargs


_guards: "weakref.WeakKeyDictionary[nn.Module, _Guard]" = weakref.WeakKeyDictionary()


def guard(model: nn.Module, comm) -> _Guard:
    """The pre-hook on ``model`` (registered on first use: before the
    structure is taken, which then includes it)."""
    found = _guards.get(model)
    if found is None:
        found = _guards[model] = _Guard(comm)
        model.register_forward_pre_hook(found, with_kwargs=True)
    found.comm = comm  # a later register(comm) replaces the communicator
    return found
