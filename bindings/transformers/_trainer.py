"""transformers' ``Trainer`` (and TRL's ``SFTTrainer``, which is one) context-
and data-parallel over commlib, launched by ``mpiexec``: one call,
``prepare_trainer(trainer, comm)``.

Each rank runs the Trainer as one process (accelerate sees no distributed
launch: under ``mpiexec`` it finds no ``LOCAL_RANK``), so nothing of
torch.distributed starts; commlib owns the ranks. The ranks form
data-parallel groups of ``cp_size`` consecutive context-parallel ranks. The
trainer's class is swapped, in place, for a subclass of it that:

- draws global batches (``per_device_train_batch_size`` x the data-parallel
  degree samples, the same on every rank) and collates each group's
  consecutive share of the samples, as DDP's processes would;
- counts ``num_items_in_batch`` over every group (the Trainer counts its own
  group's over the accumulation steps), cuts each micro-batch with
  ``shard_batch`` over its group, and sums the gradients of replicated
  parameters over every rank once the accumulation steps are done (each
  rank's loss is its tokens' share of the global mean), before the Trainer
  clips them by their global norm (experts' squares summed over the ranks);
- logs the loss summed over the ranks: the one-process loss;
- evaluates and predicts the whole eval batch in every group, context-
  parallel inside it, and returns the whole sequence's logits on every rank;
- writes checkpoints from rank 0 only.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import json
import os
import zlib
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch import nn

from commlib.moe.placement import EMPTY
from commlib.ring import unshard_sequence

from ._attention import layout_of, register_attention
from ._batch import shard_batch
from ._expert_checkpoint import gathered_state_dict, local_state_dict, saved_weights
from ._experts import EXPERT_PARALLEL, expert_modules, placement_of
from ._gradients import allreduce_gradients

__all__ = ["prepare_trainer"]

_GROUPS = "_commlib_groups"


class _Groups:
    """The communicators of a prepared trainer: all ranks, this rank's
    context-parallel group (consecutive ranks) and its data-parallel
    group (the ranks at its place in every context-parallel group)."""

    def __init__(self, comm, cp_size: int) -> None:
        self.world = comm
        self.cp = comm if cp_size == comm.size else comm.split(comm.rank // cp_size)
        self.dp = None if cp_size == comm.size else comm.split(comm.rank % cp_size)
        self.dp_size, self.dp_rank = comm.size // cp_size, comm.rank // cp_size


def prepare_trainer(trainer, comm, *, cp_size: Optional[int] = None):
    """Make ``trainer`` (a ``transformers.Trainer``, or a subclass such as
    TRL's ``SFTTrainer``) train, evaluate, predict and save context- and
    data-parallel over ``comm``, in place; returns it. Collective.

    ``cp_size``: ranks per context-parallel group (default: all of them);
    consecutive ranks form a group, the groups are data-parallel. The model
    attends with one of commlib's implementations (``register`` first) and
    may be ``expert_parallel`` over ``comm``. Refused on every rank, naming
    the fix: a trainer that accelerate runs distributed (torchrun, or
    ``use_cpu=True`` under mpiexec), ``TrainingArguments`` that differ
    between ranks, a ``cp_size`` that does not divide the world, and what
    the sharded loss cannot compute (label smoothing, DataParallel over
    several GPUs in one process)."""
    problem = _problem(trainer, comm, cp_size)
    values = {key: json.dumps(value, sort_keys=True, default=str)
              for key, value in sorted(trainer.args.to_dict().items())}
    comm.agree("transformers.prepare_trainer", cp_size, type(trainer.args).__name__, *values,
               problem=problem)
    comm.agree("transformers.prepare_trainer TrainingArguments",
               problem=_differing(comm, values))
    groups = _Groups(comm, cp_size or comm.size)
    if groups.cp is not comm:
        register_attention(groups.cp)
    setattr(trainer, _GROUPS, groups)
    trainer.__class__ = _prepared(type(trainer))
    trainer._train_batch_size *= groups.dp_size
    trainer.args = _saving_on_rank_zero(trainer.args, comm.rank)
    return trainer


def _differing(comm, values: Dict[str, str]) -> Optional[ValueError]:
    """The training arguments whose values differ between ranks (each
    compared by a digest: two small allreduces), with this rank's values."""
    digests = np.array([zlib.crc32(value.encode()) for value in values.values()], dtype=np.int64)
    differ = comm.allreduce(digests, op="max") != comm.allreduce(digests, op="min")
    named = [f"{key}={value}" for (key, value), odd in zip(values.items(), differ) if odd]
    return ValueError(f"TrainingArguments differ between ranks, here {', '.join(named)}: every "
                      f"rank must train with the same arguments") if named else None


def _problem(trainer, comm, cp_size: Optional[int]) -> Optional[ValueError]:
    """Why ``trainer`` cannot be prepared (None: it can)."""
    args = trainer.args
    if cp_size is not None and (isinstance(cp_size, bool) or not isinstance(cp_size, int)
                                or cp_size < 1 or comm.size % cp_size):
        return ValueError(f"cp_size={cp_size!r} must be a positive int that divides the number "
                          f"of ranks ({comm.size})")
    if args.world_size != 1 or os.environ.get("LOCAL_RANK") is not None:
        return ValueError(
            f"accelerate runs this Trainer distributed over {args.world_size} processes "
            f"(torch.distributed: a torchrun launch, or use_cpu=True under mpiexec, which makes "
            f"accelerate start it from the MPI environment); commlib owns the ranks: launch "
            f"with mpiexec, without use_cpu (a machine with no GPU trains on the CPU anyway)")
    if getattr(trainer, _GROUPS, None) is not None:
        return ValueError("prepare_trainer was called twice on this trainer")
    if args.label_smoothing_factor:
        return ValueError(f"label_smoothing_factor={args.label_smoothing_factor}: the Trainer's "
                          f"label smoother shifts the labels again inside each shard; not "
                          f"implemented under context parallelism (use 0)")
    if args.push_to_hub and any(getattr(p, EXPERT_PARALLEL, False)
                                for p in trainer.model.parameters()):
        return ValueError("push_to_hub with expert-parallel experts is not implemented: push "
                          "the saved checkpoint (one copy of every expert) yourself")
    if args.n_gpu > 1:
        return ValueError(f"the Trainer would run torch's DataParallel over {args.n_gpu} GPUs "
                          f"in each process: give each rank one GPU (CUDA_VISIBLE_DEVICES)")
    try:
        layout_of(trainer.model)
    except ValueError as error:
        return error
    return None


def _saving_on_rank_zero(args, rank: int):
    """A copy of ``args`` whose ``should_save`` holds on rank 0 only (each
    rank is process 0 to accelerate), pickled as the user's class (the
    checkpoint's training_args.bin)."""
    base = type(args)

    def as_given(self, protocol: int):
        return copyreg._reconstructor, (base, object, None), dict(self.__dict__)
    saving = type(f"{base.__name__}OnRankZero", (base,),
                  {"should_save": property(lambda self: rank == 0 and base.should_save.fget(self)),
                   "__reduce_ex__": as_given})
    copied = object.__new__(saving)
    copied.__dict__.update(args.__dict__)
    return copied


class _GroupShare:
    """A collator that collates this data-parallel group's consecutive
    share of a global batch's samples."""

    def __init__(self, collate, groups: _Groups) -> None:
        self.collate, self.groups = collate, groups

    def __call__(self, samples: List[Any]) -> Any:
        count, groups = len(samples), self.groups.dp_size
        if count < groups:
            raise ValueError(f"a global batch of {count} samples cannot give each of the "
                             f"{groups} data-parallel groups one: set dataloader_drop_last=True, "
                             f"or a dataset whose last batch has at least {groups} samples")
        bounds = np.linspace(0, count, groups + 1).round().astype(int)
        rank = self.groups.dp_rank
        return self.collate(samples[bounds[rank]:bounds[rank + 1]])


class CommlibTrainer:
    """The methods ``prepare_trainer`` puts in front of a Trainer's."""

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        groups = getattr(self, _GROUPS)
        if groups.dp_size > 1:
            loader.collate_fn = _GroupShare(loader.collate_fn, groups)
        return loader

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        counted = super()._get_num_items_in_batch(batch_samples, device)
        groups = getattr(self, _GROUPS)
        if counted is None or groups.dp is None:
            return counted
        return groups.dp.allreduce(torch.as_tensor(counted).reshape(1))[0].to(device)

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch=None) -> torch.Tensor:
        groups = getattr(self, _GROUPS)
        shard = shard_batch(dict(inputs), groups.cp, attn_implementation=self.model)
        with _metrics_over(self.accelerator, groups.world):
            loss = super().training_step(model, shard, num_items_in_batch)
        if self.accelerator.sync_gradients:
            allreduce_gradients(self.model, groups.world)
        return loss

    def _clip_grad_norm(self, model: nn.Module):
        if not _experts(self.model):
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        norm = _global_norm(self.model, getattr(self, _GROUPS).world)
        torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.args.max_grad_norm,
                                             norm)
        return norm

    def _get_grad_norm(self, model: nn.Module, grad_norm=None):
        if grad_norm is None and _experts(self.model):
            return _global_norm(self.model, getattr(self, _GROUPS).world)
        return super()._get_grad_norm(model, grad_norm)

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            tr_loss.copy_(getattr(self, _GROUPS).world.allreduce(tr_loss.detach().reshape(1))[0])
        super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)

    def _finalize_training(self, *args: Any, **kwargs: Any):
        self._tr_loss.copy_(getattr(self, _GROUPS).world.allreduce(
            self._tr_loss.detach().reshape(1))[0])
        return super()._finalize_training(*args, **kwargs)

    def prediction_step(self, model: nn.Module, inputs: Dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[List[str]] = None):
        groups = getattr(self, _GROUPS)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None
                                                     for k in self.label_names)
        labels = inputs.get("labels") if has_labels else None
        shard = shard_batch(dict(inputs), groups.cp, attn_implementation=self.model)
        if not has_labels:
            for key in ("labels", "shift_labels", "num_items_in_batch"):
                shard.pop(key)
        shard = self._prepare_inputs(shard)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**shard)
        loss = None
        if has_labels:
            loss = groups.cp.allreduce(outputs["loss"].detach().reshape(1))[0]
        if prediction_loss_only:
            return loss, None, None
        ignore = (ignore_keys if ignore_keys is not None else
                  getattr(self.model.config, "keys_to_ignore_at_inference", ["cache"]))
        logits = [unshard_sequence(value.detach(), groups.cp, layout=layout_of(self.model),
                                   cu_seqlens=shard["cu_seq_lens_q"].tolist())
                  for key, value in outputs.items()
                  if key not in [*ignore, "loss"] and _per_token(value, shard)]
        return loss, logits[0] if len(logits) == 1 else tuple(logits), labels

    def is_world_process_zero(self) -> bool:
        return getattr(self, _GROUPS).world.rank == 0

    def is_local_process_zero(self) -> bool:
        return getattr(self, _GROUPS).world.topology.local_rank == 0

    def _save_rng_state(self, output_dir: str) -> None:
        if self.args.should_save:  # every rank's generators are rank 0's
            super()._save_rng_state(output_dir)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        if not _experts(self.model):
            return super().save_model(output_dir, _internal_call)
        # every rank calls save_model (transformers calls _save on rank 0 alone before 5.20)
        whole = gathered_state_dict(self.model)
        with _in_model_layout(self.model):
            self._save(output_dir, state_dict=whole)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if _experts(self.model):  # each rank's experts' optimizer state is its own
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.optimizer.state_dict(), _optimizer_file(output_dir, self))

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        problem = None
        try:
            super()._save_checkpoint(model, trial)
        except Exception as error:  # noqa: BLE001  (rank 0 writes: the others must hear of it)
            problem = error
        # every rank raises what failed, and none reads a checkpoint before rank 0 wrote it
        getattr(self, _GROUPS).world.agree("Trainer checkpoint written", problem=problem)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        model = self.model if model is None else model
        if not _experts(model):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        whole = saved_weights(resume_from_checkpoint)
        self._issue_warnings_after_load(model.load_state_dict(local_state_dict(model, whole),
                                                              strict=False))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and _experts(self.model):
            self.optimizer.load_state_dict(torch.load(_optimizer_file(checkpoint, self),
                                                      map_location="cpu", weights_only=True))


@contextlib.contextmanager
def _in_model_layout(model: nn.Module) -> Iterator[None]:
    """``save_pretrained`` writes the experts as the model holds them
    ([num_experts, ...] tensors, which ``from_pretrained`` loads as they
    are), not converted back to the checkpoint's original per-expert
    layout, which ``load_state_dict`` could not read back on resume."""
    model.save_pretrained = functools.partial(model.save_pretrained, save_original_format=False)
    try:
        yield
    finally:
        del model.save_pretrained


@contextlib.contextmanager
def _metrics_over(accelerator, comm) -> Iterator[None]:
    """``accelerator.gather_for_metrics`` over every rank while a training
    step runs: what a trainer sums of it (TRL's token counts, entropy and
    accuracy) is then the whole batch's, not this rank's shard's."""
    accelerator.gather_for_metrics = lambda value: comm.allgather(
        torch.as_tensor(value).reshape(-1))
    try:
        yield
    finally:
        del accelerator.gather_for_metrics


def _optimizer_file(directory: str, trainer) -> str:
    groups = getattr(trainer, _GROUPS)
    return os.path.join(directory, f"optimizer.rank{groups.world.rank}-of-{groups.world.size}.pt")


def _per_token(value: Any, shard: Dict[str, Any]) -> bool:
    """An output with the shard's sequence axis (logits, hidden states)."""
    return isinstance(value, torch.Tensor) and value.ndim >= 2 and \
        value.shape[:2] == shard["input_ids"].shape[:2]


def _experts(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if getattr(p, EXPERT_PARALLEL, False)]


def _global_norm(model: nn.Module, comm) -> torch.Tensor:
    """The 2-norm of every gradient of the model as one process holds it:
    replicated parameters (equal on every rank after the allreduce) once,
    the experts' slots summed over the ranks, a replicated expert's slots
    (equal after the allreduce) each counted 1 / its replicas."""
    def squares(grads: List[torch.Tensor]) -> torch.Tensor:
        return sum((g.detach().double().square().sum() for g in grads),
                   torch.zeros((), dtype=torch.float64))
    held = {id(p) for p in _experts(model)}
    replicated = squares([p.grad for p in model.parameters()
                          if id(p) not in held and p.grad is not None])
    spread = [torch.zeros((), dtype=torch.float64)]
    for _, module in expert_modules(model):
        placement = placement_of(module)
        share = None if placement is None else torch.tensor(
            [0.0 if e == EMPTY else 1.0 / placement.replica_counts[e]
             for e in placement.slots[comm.rank].tolist()], dtype=torch.float64)
        for parameter in module.parameters(recurse=False):
            if id(parameter) in held and parameter.grad is not None:
                per_slot = parameter.grad.detach().double().square().flatten(1).sum(1)
                spread.append((per_slot if share is None else per_slot * share).sum())
    total = comm.allreduce(sum(spread).reshape(1))[0]
    return (replicated + total).sqrt().float()


_PREPARED: Dict[type, type] = {}


def _prepared(cls: type) -> type:
    """``cls`` with ``CommlibTrainer``'s methods in front (one class per
    trainer class)."""
    if cls not in _PREPARED:
        _PREPARED[cls] = type(f"Commlib{cls.__name__}", (CommlibTrainer, cls), {})
    return _PREPARED[cls]
