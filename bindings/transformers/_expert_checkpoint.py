"""Expert-parallel weights as one process holds them, and back.

``expert_parallel`` keeps on each rank only its slots of every experts
module's ``[num_experts, ...]`` parameters. A checkpoint holds one copy of
each weight in the unsplit model's shapes, so that one process (or another
world size) loads it with ``from_pretrained``: the slots are gathered and
put back in logical expert order (a replicated expert's first replica, an
empty slot nowhere); loading takes this rank's slots of each.
"""

from __future__ import annotations

import json
import os
from typing import Dict

import safetensors.torch
import torch
from torch import nn
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from commlib.moe.placement import EMPTY

from ._experts import EXPERT_PARALLEL, dispatcher_of, expert_modules, slot_experts

__all__ = ["gathered_state_dict", "local_state_dict", "saved_weights"]


def _split_parameters(model: nn.Module) -> Dict[str, nn.Module]:
    """The state-dict names of the expert-parallel parameters, and their
    experts module."""
    return {f"{name}.{key}": module for name, module in expert_modules(model)
            for key, parameter in module.named_parameters(recurse=False)
            if getattr(parameter, EXPERT_PARALLEL, False)}


def _slots(module: nn.Module):
    core = dispatcher_of(module).core
    return core.comm, slot_experts(module.num_experts, core.comm.size, core.placement)


def gathered_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` with every expert-parallel parameter whole, in
    logical expert order (collective over the experts' communicator)."""
    state = model.state_dict()
    for name, module in _split_parameters(model).items():
        comm, slots = _slots(module)
        local = state[name]
        gathered = comm.allgather(local.detach().contiguous(), axis=0)
        whole = local.new_empty((module.num_experts, *local.shape[1:]))
        filled = set()
        for index, expert in enumerate(e for held in slots for e in held):
            if expert != EMPTY and expert not in filled:
                whole[expert] = gathered[index]
                filled.add(expert)
        state[name] = whole
    return state


def local_state_dict(model: nn.Module, whole: Dict[str, torch.Tensor]
                     ) -> Dict[str, torch.Tensor]:
    """A whole state dict (``gathered_state_dict``'s, or the unsplit
    model's) cut to this rank's slots of every expert-parallel parameter
    (an empty slot zeros)."""
    cut = dict(whole)
    for name, module in _split_parameters(model).items():
        if name not in cut:
            continue
        comm, slots = _slots(module)
        held = torch.tensor(slots[comm.rank])
        part = cut[name][held.clamp(min=0)]
        part[held == EMPTY] = 0
        cut[name] = part
    return cut


def saved_weights(directory: str) -> Dict[str, torch.Tensor]:
    """The whole state dict ``save_pretrained`` wrote to ``directory`` (one
    safetensors file, or the shards its index names), on the CPU."""
    index = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        return safetensors.torch.load_file(os.path.join(directory, SAFE_WEIGHTS_NAME))
    with open(index) as handle:
        files = sorted(set(json.load(handle)["weight_map"].values()))
    return {name: tensor for file in files
            for name, tensor in safetensors.torch.load_file(os.path.join(directory, file)).items()}
