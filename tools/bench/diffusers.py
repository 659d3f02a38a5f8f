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
"""

from __future__ import annotations

import copy
import os
from contextlib import contextmanager
from typing import Callable, Dict

import click
import numpy as np
import torch

from .timing import best_local, first_rank_alone, interleaved, json_option, write_json


def _model(double: int, single: int, heads: int, head_dim: int):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    quarter = head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
        attention_head_dim=head_dim, num_attention_heads=heads, joint_attention_dim=64,
        pooled_projection_dim=64, axes_dims_rope=(quarter, quarter, head_dim - 2 * quarter)).eval()


def _inputs(image: int, text: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, image, 16, generator=gen),
                encoder_hidden_states=torch.randn(1, text, 64, generator=gen),
                pooled_projections=torch.randn(1, 64, generator=gen),
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
@json_option
def main(image: int, text: int, double: int, single: int, heads: int, head_dim: int,
         iters: int, threads: int, groups, json_path) -> None:
    """Seconds per forward: diffusers' Ulysses (gloo) and commlib's, Ring,
    hybrid, on P ranks; the whole model in one process."""
    import commlib
    from commlib.bindings import diffusers as cd

    torch.set_num_threads(threads)
    comm = commlib.init()
    world = comm.mpi_comm
    step = _inputs(image, text)
    base = _model(double, single, heads, head_dim)
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
        print(f"Flux, {double} double + {single} single blocks, {heads} heads of {head_dim}, "
              f"{image} image + {text} text tokens, float32, {comm.size} ranks x {threads} "
              f"threads; forward, median of {iters} interleaved rounds (slowest rank)")
        print(f"  {'one process':36s} {alone:8.3f} s")
        print(f"  {'compute alone (one process / P)':36s} {alone / comm.size:8.3f} s")
        for name, seconds in medians.items():
            print(f"  {name:36s} {seconds:8.3f} s   {seconds / reference:5.2f}x diffusers' "
                  f"Ulysses   {alone / seconds:5.2f}x faster than one process   exposed "
                  f"{seconds - alone / comm.size:6.3f} s")
    write_json(json_path, {"one_process": alone, **medians}, comm.rank)
    import torch.distributed as dist
    dist.destroy_process_group()
    comm.free()


if __name__ == "__main__":
    main()
