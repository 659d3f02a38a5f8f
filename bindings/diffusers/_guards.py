"""The model's own methods that commlib intercepts while it holds the model.

Set as attributes of the instance (shadowing the class's methods for this
model alone, removed by ``unguard``):

- diffusers' ``enable_parallelism`` refuses, by name: the model is already
  context-parallel through commlib, and diffusers' own parallelism on top
  would fail in torch.distributed (or shard twice);
- diffusers' adapter methods (``load_lora_adapter``, ``fuse_lora``,
  ``set_adapters``, ...; pipelines call them on the model) run, then mark
  the weights stale, so that the next forward reads and agrees on them
  again (``_weights.py``): loading an adapter adds tensors that no version
  counter announces.
"""

from __future__ import annotations

import functools
from typing import Callable, List

import torch

from ._weights import Weights

ADAPTER_METHODS = ("load_lora_adapter", "add_adapter", "set_adapter", "set_adapters",
                   "enable_adapters", "disable_adapters", "enable_lora", "disable_lora",
                   "fuse_lora", "unfuse_lora", "unload_lora", "delete_adapters")


def guard(model: torch.nn.Module, weights: Weights) -> List[str]:
    """Shadow the methods; returns their names, for ``unguard``."""
    name = type(model).__name__

    def enable_parallelism(*args, **kwargs):
        raise ValueError(f"{name} is already context-parallel through commlib.bindings."
                         f"diffusers: diffusers' enable_parallelism cannot be added on top; "
                         f"undo commlib's first (remove_context_parallel(model))")
    shadows = {"enable_parallelism": enable_parallelism}
    for method in ADAPTER_METHODS:
        if hasattr(type(model), method):
            shadows[method] = _then_stale(getattr(model, method), weights)
    for method, shadow in shadows.items():
        object.__setattr__(model, method, shadow)
    return list(shadows)


def unguard(model: torch.nn.Module, names: List[str]) -> None:
    for method in names:
        model.__dict__.pop(method, None)


def _then_stale(method: Callable, weights: Weights) -> Callable:
    @functools.wraps(method)
    def call(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        finally:
            weights.mark_stale()
    return call
