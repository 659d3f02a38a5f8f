"""A tiny-ish Flux transformer's forward, context-parallel: diffusers' own
Ulysses over torch.distributed (gloo) against commlib's Ulysses, Ring and
hybrid (``commlib.bindings.diffusers``), its Ulysses overlapped with the
projection (``overlap_groups``, ``--groups``) and with the FP8 wire, in
the same processes, and the whole model in one process. Exposed
communication: a contender's time less the one-process time / P (the same
work split P ways, no communication; the binding's own overhead counts as
exposed).

    mpiexec -n 2 python -m commlib.tools.bench.diffusers

Every contender runs the same weights on the same global inputs; the
outputs are checked equal before anything is timed (the FP8 wire's within
1e-2 of max |out|). Interleaved rounds,
the slowest rank's time per forward, medians (``timing.py``).

``--checks`` measures instead what the binding's agreements cost (commlib's
Ulysses): ``context_parallel`` (a digest of every weight, agreed), the
agreement that opens each forward (the inputs and the weights, timed
between two hooks of the model's own around it) against the whole forward,
and a forward after every weight changed (as after an optimizer step:
every weight digested again). A real-size Flux block::

    mpiexec -n 2 python -m commlib.tools.bench.diffusers --checks --double 1 --single 1 \
        --heads 24 --head-dim 128 --channels 64 --text-dim 4096 --pooled-dim 768 \
        --image 1024 --text 512 --iters 5
"""

from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, List

import click
import numpy as np
import torch

from .timing import (
    best_local,
    first_rank_alone,
    interleaved,
    json_option,
    slowest,
    write_json,
)


@dataclass(frozen=True)
class Shape:
    """The Flux measured: its blocks and widths."""

    double: int
    single: int
    heads: int
    head_dim: int
    channels: int = 16
    text_dim: int = 64
    pooled_dim: int = 64


def _model(shape: Shape):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    quarter = shape.head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1, in_channels=shape.channels, num_layers=shape.double,
        num_single_layers=shape.single, attention_head_dim=shape.head_dim,
        num_attention_heads=shape.heads, joint_attention_dim=shape.text_dim,
        pooled_projection_dim=shape.pooled_dim,
        axes_dims_rope=(quarter, quarter, shape.head_dim - 2 * quarter)).eval()


def _inputs(shape: Shape, image: int, text: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, image, shape.channels, generator=gen),
                encoder_hidden_states=torch.randn(1, text, shape.text_dim, generator=gen),
                pooled_projections=torch.randn(1, shape.pooled_dim, generator=gen),
                timestep=torch.tensor([0.5]), img_ids=torch.randn(image, 3, generator=gen),
                txt_ids=torch.zeros(text, 3))


@contextmanager
def _cpu_counted_as_an_accelerator():
    """WORKAROUND, for this benchmark only: diffusers 0.42's
    ``enable_parallelism`` places rank r on device ``r % torch.accelerator.
    device_count()``, which is 0 on a CPU-only machine (ZeroDivisionError);
    counted as 1 while it runs, every rank takes ``cpu:0`` and its mesh is
    gloo's."""
    count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def _diffusers_ulysses(model, world):
    """diffusers' own Ulysses over a gloo process group made from the MPI world (its
    hooks refuse the model's output dataclass: call it with return_dict=False)."""
    import torch.distributed as dist
    from diffusers import ContextParallelConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(world.bcast(29500 + os.getpid() % 2000, root=0))
    dist.init_process_group("gloo", rank=world.Get_rank(), world_size=world.Get_size())
    with _cpu_counted_as_an_accelerator():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world.Get_size()))
    return model


@click.command()
@click.option("--image", default=4096, show_default=True, help="Image tokens.")
@click.option("--text", default=128, show_default=True, help="Text tokens.")
@click.option("--double", default=2, show_default=True, help="Double-stream blocks.")
@click.option("--single", default=2, show_default=True, help="Single-stream blocks.")
@click.option("--heads", default=4, show_default=True, help="Attention heads.")
@click.option("--head-dim", default=32, show_default=True, help="Channels per head.")
@click.option("--iters", default=9, show_default=True, help="Interleaved rounds.")
@click.option("--threads", default=1, show_default=True, help="torch threads per process.")
@click.option("--groups", multiple=True, type=int, default=(2,), show_default=True,
              help="overlap_groups of the overlapped Ulysses (repeat for several).")
@click.option("--channels", default=16, show_default=True, help="Latent channels.")
@click.option("--text-dim", default=64, show_default=True, help="Prompt embedding width.")
@click.option("--pooled-dim", default=64, show_default=True, help="Pooled projection width.")
@click.option("--checks", is_flag=True,
              help="Time the binding's agreements (weights, each forward's inputs) instead.")
@json_option
def main(image: int, text: int, double: int, single: int, heads: int, head_dim: int,
         iters: int, threads: int, groups, channels: int, text_dim: int, pooled_dim: int,
         checks: bool, json_path) -> None:
    """Seconds per forward: diffusers' Ulysses (gloo) and commlib's, Ring,
    hybrid, on P ranks; the whole model in one process (``--checks``: what
    the binding's agreements cost)."""
    import commlib

    torch.set_num_threads(threads)
    comm = commlib.init()
    shape = Shape(double, single, heads, head_dim, channels, text_dim, pooled_dim)
    step = _inputs(shape, image, text)
    if checks:
        _time_checks(comm, _model(shape), step, shape, iters, json_path)
    else:
        _compare(comm, _model(shape), step, shape, iters, threads, groups, json_path)
    comm.free()


def _compare(comm, base, step: Dict[str, torch.Tensor], shape: Shape, iters: int,
             threads: int, groups, json_path) -> None:
    """diffusers' Ulysses against commlib's contenders and one process."""
    from commlib.bindings import diffusers as cd

    world = comm.mpi_comm
    image, text = step["hidden_states"].shape[1], step["encoder_hidden_states"].shape[1]
    with torch.no_grad():
        whole = first_rank_alone(world, lambda: base(**step).sample)
        alone = first_rank_alone(world, lambda: best_local(lambda: base(**step), 3))
        theirs = _diffusers_ulysses(copy.deepcopy(base), world)
        splits = {"commlib ulysses": (1, comm.size), "commlib ring": (comm.size, 1)}
        if comm.size % 2 == 0 and comm.size > 2:
            splits["commlib hybrid"] = (2, comm.size // 2)
        ours = {name: cd.context_parallel(copy.deepcopy(base), comm, ring_degree=ring,
                                          ulysses_degree=ulysses)
                for name, (ring, ulysses) in splits.items()}
        for n in groups:
            ours[f"commlib ulysses, {n} groups"] = cd.context_parallel(
                copy.deepcopy(base), comm, overlap_groups=n)
        fp8 = {"wire": "float8"}
        ours["commlib ulysses, float8"] = cd.context_parallel(copy.deepcopy(base), comm,
                                                              attention_options=fp8)
        ours[f"commlib ulysses, {groups[0]} groups, float8"] = cd.context_parallel(
            copy.deepcopy(base), comm, overlap_groups=groups[0], attention_options=fp8)
        contenders: Dict[str, Callable[[], object]] = {
            "diffusers ulysses (gloo)": lambda: theirs(**step, return_dict=False)[0]}
        contenders.update({name: (lambda m=m: m(**step).sample) for name, m in ours.items()})
        for name, call in contenders.items():
            error = float((call() - whole).abs().max())
            if error > (1e-2 * float(whole.abs().max()) if "float8" in name else 1e-4):
                raise SystemExit(f"{name}: output differs from the one-process model by {error}")
        times = interleaved(world, contenders, iters)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    reference = medians["diffusers ulysses (gloo)"]
    if comm.rank == 0:
        print(f"Flux, {_described(shape)}, {image} image + {text} text tokens, float32, "
              f"{comm.size} ranks x {threads} threads; forward, median of {iters} interleaved "
              f"rounds (slowest rank)")
        print(f"  {'one process':36s} {alone:8.3f} s")
        print(f"  {'compute alone (one process / P)':36s} {alone / comm.size:8.3f} s")
        for name, seconds in medians.items():
            print(f"  {name:36s} {seconds:8.3f} s   {seconds / reference:5.2f}x diffusers' "
                  f"Ulysses   {alone / seconds:5.2f}x faster than one process   exposed "
                  f"{seconds - alone / comm.size:6.3f} s")
    write_json(json_path, {"one_process": alone, **medians}, comm.rank)
    import torch.distributed as dist
    dist.destroy_process_group()


def _described(shape: Shape) -> str:
    return (f"{shape.double} double + {shape.single} single blocks, {shape.heads} heads of "
            f"{shape.head_dim}, prompt embeddings of {shape.text_dim}")


def _time_checks(comm, model, step: Dict[str, torch.Tensor], shape: Shape, iters: int,
                 json_path) -> None:
    """context_parallel (the weights' digest and agreement), the agreement
    opening each forward against the forward, a forward after every weight
    changed: the slowest rank's seconds, medians of ``iters``."""
    from mpi4py import MPI

    from commlib.bindings import diffusers as cd

    world = comm.mpi_comm
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    setup = []
    for _ in range(iters):
        setup.append(slowest(world, lambda: cd.context_parallel(model, comm)))
        cd.remove_context_parallel(model)
    cd.context_parallel(model, comm)
    opened: List[float] = []  # seconds from before the binding's opening hook to after it
    hooks = [model.register_forward_pre_hook(lambda *_: opened.append(time.perf_counter()),
                                             prepend=True),
             model.register_forward_pre_hook(lambda *_: opened.append(time.perf_counter()
                                                                      - opened.pop()))]

    def forward():
        with torch.no_grad():
            model(**step)

    def changed_forward():
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.mul_(1)  # as an optimizer step: every version counter moves
        return slowest(world, forward)
    def slowest_median(seconds: List[float]) -> float:
        return world.allreduce(float(np.median(seconds)), op=MPI.MAX)
    forward()
    opened.clear()
    forwards = [slowest(world, forward) for _ in range(iters)]
    agreements = slowest_median(opened)
    opened.clear()
    after_change = [changed_forward() for _ in range(iters)]
    medians = {"context_parallel": float(np.median(setup)), "forward": float(np.median(forwards)),
               "opening agreement": agreements,
               "forward after every weight changed": float(np.median(after_change)),
               "its opening agreement": slowest_median(opened)}
    if comm.rank == 0:
        image, text = step["hidden_states"].shape[1], step["encoder_hidden_states"].shape[1]
        print(f"Flux, {_described(shape)}: {weights / 2**30:.2f} GiB of weights; {image} image "
              f"+ {text} text tokens, float32, {comm.size} ranks, commlib Ulysses; medians of "
              f"{iters} (slowest rank)")
        for name, seconds in medians.items():
            print(f"  {name:36s} {seconds:9.4f} s")
        ratio = medians["forward"] / (medians["forward"] - agreements)
        print(f"  {'forward with the checks / without':36s} {ratio:9.4f}")
    write_json(json_path, medians, comm.rank)
    for hook in hooks:
        hook.remove()
    cd.remove_context_parallel(model)


if __name__ == "__main__":
    main()
