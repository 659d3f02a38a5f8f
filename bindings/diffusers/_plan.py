"""A model's ``_cp_plan``, read into torch hooks of this binding's own.

The plan maps submodule names (``""`` the model, ``"blocks.0"``,
``"transformer_blocks.*"`` for every block) to what to do there:

- a dict of ``ContextParallelInput``: split these inputs of the module's
  forward, by parameter name (a forward pre-hook), or, where
  ``split_output``, its outputs by position (a forward hook; RoPE tables);
- ``ContextParallelOutput`` (or several, one per output): gather the
  module's outputs along ``gather_dim``, padding cut (a forward hook).

As in diffusers, a tensor whose number of dimensions is not the plan's
``expected_dims`` is left whole (Wan's timestep: per token only in Wan 2.2
TI2V), but for position ids with a leading batch of one (Flux's deprecated
3-D ``img_ids``), which are split one axis further in. Shards are padded
to equal lengths (``_shards.py``); which stream a gathered output belongs to
is read from its length.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Sequence, Union

import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from ._shards import as_shares, gather
from ._streams import IMAGE, Streams

Handle = torch.utils.hooks.RemovableHandle


def modules_named(model: torch.nn.Module, name: str) -> List[torch.nn.Module]:
    """The submodules a plan key names; ``*`` stands for every entry of a
    ModuleList."""
    found = [model]
    for atom in name.split(".") if name else []:
        step = []
        for module in found:
            if atom == "*":
                if not isinstance(module, torch.nn.ModuleList):
                    raise ValueError(f"_cp_plan key {name!r}: '*' must stand for a ModuleList's "
                                     f"entries, not a {type(module).__name__}'s")
                step.extend(module)
            elif atom in module._modules:
                step.append(module._modules[atom])
            else:
                raise ValueError(f"_cp_plan key {name!r}: {type(module).__name__} has no "
                                 f"submodule {atom!r}")
        found = step
    return found


def check_fits(model: torch.nn.Module, plan: Dict[str, Any]) -> None:
    """Refuse, before any hook is installed, a plan that does not fit this
    model: a key naming a submodule it lacks (Helios' plan names blocks 0-39
    one by one: a Helios of fewer blocks), an entry of another kind."""
    for where, entry in plan.items():
        try:
            modules_named(model, where)
            if not isinstance(entry, dict):
                _outputs(where, entry)
        except ValueError as error:
            raise ValueError(f"{type(model).__name__}'s own _cp_plan does not fit this instance: "
                             f"{error}") from None


def install(model: torch.nn.Module, plan: Dict[str, Any], streams: Streams, comm) -> List[Handle]:
    """Hooks that carry out ``plan`` on ``model`` (first: the one that starts
    each forward's record; last: the output's gradient counted as shares,
    ``_shards.as_shares``)."""
    handles = [model.register_forward_pre_hook(_beginning(streams, model), with_kwargs=True,
                                               prepend=True)]
    for where, entry in plan.items():
        for module in modules_named(model, where):
            if isinstance(entry, dict):
                handles.append(module.register_forward_pre_hook(
                    _input_splitter(where, module, entry, streams), with_kwargs=True))
                if any(isinstance(k, int) for k in entry):
                    handles.append(module.register_forward_hook(
                        _output_splitter(where, entry, streams)))
            else:
                handles.append(module.register_forward_hook(
                    _gatherer(where, _outputs(where, entry), streams, comm)))
    handles.append(model.register_forward_hook(lambda module, args, output:
                                               as_shares(output, comm.size)))
    return handles


def _outputs(where: str, entry: Any) -> Sequence[ContextParallelOutput]:
    entries = [entry] if isinstance(entry, ContextParallelOutput) else entry
    if not isinstance(entries, (list, tuple)) or not all(
            isinstance(e, ContextParallelOutput) for e in entries):
        raise ValueError(f"_cp_plan[{where!r}] is neither a dict of ContextParallelInput nor "
                         f"ContextParallelOutput(s): {entry!r}")
    return entries


def _parameters(module: torch.nn.Module) -> List[str]:
    return list(inspect.signature(module.forward).parameters)


def _beginning(streams: Streams, model: torch.nn.Module) -> Callable:
    names = _parameters(model)

    def begin(module, args, kwargs):
        streams.begin({**dict(zip(names, args)), **kwargs})
    return begin


def _input_splitter(where: str, module: torch.nn.Module, entry: Dict[Any, Any],
                    streams: Streams) -> Callable:
    names = _parameters(module)
    inputs = {name: plan for name, plan in entry.items()
              if isinstance(name, str) and not _splits_output(plan)}

    def split_inputs(module, args, kwargs):
        args = list(args)
        for name, plan in inputs.items():
            if name in kwargs:
                kwargs[name] = _split_value(name, kwargs[name], plan, streams, where)
            elif name in names and names.index(name) < len(args):
                at = names.index(name)
                args[at] = _split_value(name, args[at], plan, streams, where)
        return tuple(args), kwargs
    return split_inputs


def _output_splitter(where: str, entry: Dict[Any, Any], streams: Streams) -> Callable:
    outputs = {index: plan for index, plan in entry.items() if isinstance(index, int)}

    def split_outputs(module, args, output):
        single = isinstance(output, torch.Tensor)
        values = [output] if single else list(output)
        for index, plan in outputs.items():
            if index >= len(values):
                raise ValueError(f"_cp_plan[{where!r}] splits output {index}, but the module "
                                 f"returned {len(values)}")
            values[index] = _split_value(index, values[index], plan, streams, where)
        return values[0] if single else type(output)(values)
    return split_outputs


def _splits_output(plan: Any) -> bool:
    return isinstance(plan, ContextParallelInput) and plan.split_output


def _split_value(name: Any, value: Any, plan: Union[ContextParallelInput, Sequence[Any]],
                 streams: Streams, where: str) -> Any:
    """A tensor split by its plan, or a tuple of them by theirs."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if not isinstance(plan, (list, tuple)) or len(plan) != len(value):
            raise ValueError(f"_cp_plan[{where!r}][{name!r}]: {len(value)} values, plan "
                             f"{plan!r}")
        return type(value)(_split_value(f"{name}[{i}]", v, p, streams, where)
                           for i, (v, p) in enumerate(zip(value, plan)))
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"_cp_plan[{where!r}] splits {name!r}, which is a "
                         f"{type(value).__name__}, not a tensor")
    split_dim = plan.split_dim
    if plan.expected_dims is not None and value.dim() != plan.expected_dims:
        if not _batched_ids(name, value, plan):
            return value
        split_dim += 1  # Flux's deprecated [1, tokens, axes] ids: the model takes ids[0]
    if streams.keeps_whole(name, value, split_dim, where):
        return value
    return streams.split(name, value, split_dim, where)


def _batched_ids(name: Any, value: torch.Tensor, plan: ContextParallelInput) -> bool:
    """Position ids with a leading batch of one where the plan expects none
    (diffusers deprecated them; Flux warns and takes ``ids[0]``): split one
    axis further in, so that the model's ``ids[0]`` is this rank's shard,
    where diffusers' own hooks leave them whole and the RoPE table then
    disagrees with the split image."""
    return (isinstance(name, str) and name.endswith("_ids")
            and value.dim() == plan.expected_dims + 1 and value.shape[0] == 1)


def _gatherer(where: str, outputs: Sequence[ContextParallelOutput], streams: Streams,
              comm) -> Callable:
    def gather_outputs(module, args, output):
        single = isinstance(output, torch.Tensor)
        values = [output] if single else list(output)
        if len(values) != len(outputs):
            raise ValueError(f"_cp_plan[{where!r}] gathers {len(outputs)} outputs, the module "
                             f"returned {len(values)}")
        for i, plan in enumerate(outputs):
            if plan is None or (plan.expected_dims is not None
                                and values[i].dim() != plan.expected_dims):
                continue
            split = _stream_of(values[i].shape[plan.gather_dim], streams, where)
            values[i] = gather(values[i], plan.gather_dim, split, comm)
        return values[0] if single else type(output)(values)
    return gather_outputs


def _stream_of(local: int, streams: Streams, where: str):
    """The split an output of ``local`` tokens per rank was cut by: the
    image's where it fits, else the only one that fits."""
    image = streams.image
    if image is not None and image.padded == local:
        return image
    fits = {split for split in streams.splits.values() if split.padded == local}
    if len(fits) != 1:
        raise ValueError(f"_cp_plan[{where!r}] gathers an output of {local} tokens per rank, "
                         f"which " + ("no split of this forward has" if not fits else
                                      f"several splits have ({sorted(s.length for s in fits)} "
                                      f"tokens)") + f"; the image stream is "
                         f"{IMAGE!r}")
    return fits.pop()

