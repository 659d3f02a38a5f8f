"""A model's weights (parameters and buffers), watched for changes.

Every rank computes its shards with its own copy of the weights, so they
are agreed when the model is made context-parallel and again, as one item
of every forward's agreement (``_streams.py``), whenever they may have
changed since. Telling that costs a pass over the tensors' identities,
addresses and version counters (no contents), and reading them again
costs a digest of the tensors that changed (``_fingerprints.py``).

Seen: a tensor written in place by autograd-visible operations (bumps its
version: ``load_state_dict``, ``copy_`` under ``no_grad``, an optimizer's
step), a tensor replaced (``load_state_dict(assign=True)``, ``module.weight
= ...``, ``p.data = ...``), and whatever diffusers' adapter methods do
(``load_lora_adapter``, ``fuse_lora``, ``delete_adapters``, ...: ``_guards.py``
marks the weights stale when one is called). Not seen: a write through
``p.data`` (it bypasses the version counter) outside those methods, a
submodule replaced by hand, and what is not a tensor (an adapter's scale).
"""

from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Tuple

import torch

from ._fingerprints import Item, combined, tensor_digests, tensor_form, version_of

WEIGHTS = "weights"
SAME_WEIGHTS = ("Build the model the same way on every rank (the same seed or checkpoint, the "
                "same adapters, loaded and fused alike)")

# (the dict holding it, its key there, the tensor, its address, its version)
Watched = Tuple[Dict[str, Optional[torch.Tensor]], str, torch.Tensor, int, Optional[int]]


class Weights:
    """The named parameters and buffers of ``model``, with their digests."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._read()

    def mark_stale(self) -> None:
        """The model's structure may have changed: read every tensor again."""
        self.stale = True

    def item(self) -> Item:
        """The weights as one item: their count and layout, a digest of their
        contents; its parts are the tensors."""
        changed = None if self.stale else self._changed()
        if changed is None:
            self._read()
        elif changed:
            self._redigest(changed)
        return Item(WEIGHTS, self.form, self.digest, parts=self.parts)

    def _changed(self) -> Optional[List[int]]:
        """The tensors written since they were digested; None where one was
        replaced (then all are read again). One pass, no contents."""
        changed = []
        for i, (owner, key, tensor, address, version) in enumerate(self.watched):
            if owner.get(key) is not tensor:
                return None
            if (version is not None and tensor._version != version) or \
                    tensor.data_ptr() != address:
                changed.append(i)
        return changed

    def parts(self) -> List[Item]:
        return [Item(name, tensor_form(tensor), digest) for name, (_, _, tensor, _, _), digest
                in zip(self.names, self.watched, self.digests)]

    def _read(self) -> None:
        self.names: List[str] = []
        self.watched: List[Watched] = []
        seen = set()
        for prefix, module in self.model.named_modules():
            for owner in (module._parameters, module._buffers):
                for key, tensor in owner.items():
                    if tensor is None or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))
                    self.names.append(f"{prefix}.{key}" if prefix else key)
                    self.watched.append(_watched(owner, key, tensor))
        layout = "\n".join(f"{name}: {tensor_form(w[2])}" for name, w in zip(self.names,
                                                                             self.watched))
        self.form = (f"{len(self.watched)} parameters and buffers (names, shapes and dtypes "
                     f"{zlib.crc32(layout.encode()):08x})")
        self.digests = tensor_digests([w[2] for w in self.watched])
        self.digest = combined(self.digests)
        self.stale = False

    def _redigest(self, changed: List[int]) -> None:
        for i, digest in zip(changed, tensor_digests([self.watched[i][2] for i in changed])):
            owner, key, tensor = self.watched[i][:3]
            self.watched[i] = _watched(owner, key, tensor)
            self.digests[i] = digest
        self.digest = combined(self.digests)


def _watched(owner: Dict[str, Optional[torch.Tensor]], key: str, tensor: torch.Tensor) -> Watched:
    return owner, key, tensor, tensor.data_ptr(), version_of(tensor)
