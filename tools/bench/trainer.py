"""transformers' Trainer over commlib (``prepare_trainer``) against the
hand-written loop over commlib on the same model (the Trainer must not add
weight of its own), and against the same Trainer in one process on the
same cores.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.trainer

(not bound to cores: the one-process Trainer runs on rank 0 with every
rank's threads, which a rank bound to one core would squeeze onto it)

A Llama (hidden 512, 8 heads, 4 layers, vocabulary 1024 by default), one
sequence of ``--seq`` tokens a step, AdamW, gradients clipped at 1.0. A
step is the optimizer step's whole span: batch, cut, forward, backward,
gradient sum, clipping, optimizer, schedule. The Trainer and the loop run
in turns (``--rounds``), each round ``--steps`` steps after one untimed
one; each step's time is its slowest rank's, the median of all reported.
The one-process Trainer runs on rank 0 with every rank's threads while the
others sleep. accelerate's own context parallelism
(``ParallelismConfig(cp_size=...)``) refuses a CPU run (it takes FSDP 2,
DeepSpeed or a GPU), so it has no row here.
"""

from __future__ import annotations

import time
from typing import Callable, List

import click
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from commlib.tools.bench.timing import first_rank_alone, json_option, write_json


def _model(hidden: int, heads: int, layers: int, seq: int, attn: str):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=seq)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _samples(seq: int, count: int) -> List[dict]:
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(1024, (seq,), generator=gen).tolist() for _ in range(count)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


class _StepTimes(TrainerCallback):
    """Each optimizer step's seconds, begin to end."""

    def __init__(self) -> None:
        self.seconds: List[float] = []
        self.start = 0.0

    def on_step_begin(self, *_, **__) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, *_, **__) -> None:
        self.seconds.append(time.perf_counter() - self.start)


def _trainer_steps(model, samples: List[dict], prepare: Callable) -> List[float]:
    """The Trainer's step times over ``samples`` (the first step untimed)."""
    times = _StepTimes()
    args = TrainingArguments(output_dir="/tmp/commlib-bench-trainer", max_steps=len(samples),
                             per_device_train_batch_size=1, learning_rate=1e-4,
                             max_grad_norm=1.0, logging_steps=10 ** 6, save_strategy="no",
                             report_to=[], disable_tqdm=True, optim="adamw_torch", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=samples,
                      data_collator=default_data_collator, callbacks=[times])
    prepare(trainer)
    trainer.train()
    return times.seconds[1:]


def _loop_steps(model, samples: List[dict], comm) -> List[float]:
    """The hand-written loop's step times over ``samples`` (the first step
    untimed): what docs/transformers.md's three lines train with."""
    from commlib.bindings import transformers as cht

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds = []
    for sample in samples:
        start = time.perf_counter()
        batch = default_data_collator([sample])
        shard = cht.shard_batch(batch, comm, attn_implementation=model)
        model(**shard).loss.backward()
        cht.allreduce_gradients(model, comm)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return seconds[1:]


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Tokens a step.")
@click.option("--hidden", default=512, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--steps", default=3, show_default=True, help="Timed steps a round.")
@click.option("--rounds", default=2, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads per rank.")
@json_option
def main(seq: int, hidden: int, heads: int, layers: int, steps: int, rounds: int,
         threads: int, json_path) -> None:
    """Seconds per Trainer step over commlib, against its loop and one process."""
    import commlib
    from commlib.bindings import transformers as cht

    comm = commlib.init()
    cht.register(comm)
    world = comm.mpi_comm
    torch.set_num_threads(threads)
    samples = _samples(seq, steps + 1)
    model = _model(hidden, heads, layers, seq, "commlib_ring")
    timed = {"Trainer + commlib": [], "hand-written loop + commlib": []}
    for _ in range(rounds):
        timed["Trainer + commlib"] += _trainer_steps(
            model, samples, lambda trainer: cht.prepare_trainer(trainer, comm))
        timed["hand-written loop + commlib"] += _loop_steps(model, samples, comm)
    slowest = {name: np.max(world.allgather(seconds), axis=0) for name, seconds in timed.items()}

    def alone() -> List[float]:
        torch.set_num_threads(threads * comm.size)
        seconds = _trainer_steps(_model(hidden, heads, layers, seq, "sdpa"), samples,
                                 lambda trainer: None)
        torch.set_num_threads(threads)
        return seconds
    slowest["Trainer, one process"] = np.asarray(first_rank_alone(world, alone))
    medians = {name: float(np.median(seconds)) for name, seconds in slowest.items()}
    loop = medians["hand-written loop + commlib"]
    if comm.rank == 0:
        print(f"Llama hidden {hidden}, {heads} heads, {layers} layers, {seq} tokens a step, "
              f"{comm.size} ranks x {threads} thread(s); median of {rounds * steps} steps")
        for name, seconds in medians.items():
            print(f"  {name:30s} {seconds:8.3f} s/step  {1 / seconds:7.3f} steps/s  "
                  f"{seconds / loop:5.2f}x the loop")
    write_json(json_path, {"seq": seq, "ranks": comm.size, "threads": threads,
                           "seconds_per_step": medians}, comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
