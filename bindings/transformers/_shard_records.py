"""What ``shard_batch`` made alongside a shard, found again when the shard
reaches the model: a record kept by the identity of the shard's
``input_ids`` tensor (a tensor hashes by identity but compares by value, so
not a ``WeakKeyDictionary``), dropped when that tensor is."""

from __future__ import annotations

import weakref
from typing import Any, Dict, Generic, Optional, Tuple, TypeVar

import torch

__all__ = ["ShardRecords"]

Record = TypeVar("Record")


class ShardRecords(Generic[Record]):
    """Records by shard: ``keep`` one, ``of`` the ``input_ids`` a forward
    was given (None for any other tensor or value)."""

    def __init__(self) -> None:
        self._kept: Dict[int, Tuple["weakref.ref[torch.Tensor]", Record]] = {}

    def keep(self, input_ids: torch.Tensor, record: Record) -> None:
        key = id(input_ids)
        self._kept[key] = (weakref.ref(input_ids), record)
        weakref.finalize(input_ids, self._kept.pop, key, None)

    def of(self, input_ids: Any) -> Optional[Record]:
        kept = self._kept.get(id(input_ids)) if isinstance(input_ids, torch.Tensor) else None
        return kept[1] if kept is not None and kept[0]() is input_ids else None
