"""``moe modes``: FP8 against bfloat16 rows, the fixed capacity against the
counted dispatch."""

from __future__ import annotations

import functools
from typing import Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.moe.workload import dispatch_combine, torch_routing
from commlib.tools.bench.timing import interleaved, json_option, write_json


@click.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--small-tokens", default=8, show_default=True,
              help="The fixed capacity's home ground: a decode step's tokens per rank.")
@click.option("--hidden", default=7168, show_default=True)
@click.option("--experts", "num_experts", default=64, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--capacity-factor", default=1.25, show_default=True,
              help="Both modes; it also sizes the fixed capacity's expert slots (without "
                   "one they would be P x tokens per expert).")
@click.option("--iters", default=5, show_default=True)
@json_option
def modes(tokens: int, small_tokens: int, hidden: int, num_experts: int, topk: int,
          capacity_factor: float, iters: int, json_path: Optional[str]) -> None:
    """FP8 vs bfloat16 rows, fixed capacity vs counted: dispatch alone and
    the dispatch + combine pair, and the payload bytes."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_moe modes: {comm.size} ranks; {hidden} bfloat16 channels, {num_experts} "
        f"experts, top-{topk}, capacity factor {capacity_factor}; identity experts; torch")
    rows = []
    for count in (tokens, small_tokens):
        x, experts, weights = torch_routing(comm, count, hidden, num_experts, topk)
        counted = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor)
        fixed = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                               max_tokens_per_rank=count)
        contenders = {}
        for mode, d in (("counted", counted), ("fixed", fixed)):
            for quantize in (None, "fp8"):
                name = f"{mode} {'fp8' if quantize else 'bf16'}"
                contenders[f"{name} dispatch"] = functools.partial(
                    d.dispatch, x, experts, weights, quantize=quantize)
                contenders[f"{name} pair"] = dispatch_combine(d, x, experts, weights, quantize)
        times = interleaved(world, contenders, iters)
        counted.stats = moe.DispatchStats.zeros(num_experts, comm.size)
        counted.dispatch(x, experts, weights)
        wide = int(counted.stats.traffic.sum())
        counted.dispatch(x, experts, weights, quantize="fp8")
        narrow = int(counted.stats.traffic.sum()) - wide
        fixed.collect_stats()
        # rows per destination, padded: the layout of the path the fixed dispatches took
        blocks = fixed.path_for(x).layout(x, topk, hidden * 2)["hops"][0][3]
        wire = {None: hidden * 2 + 8 * topk, "fp8": hidden + 4 * -(-hidden // 128) + 8 * topk}
        say(f"-- {count} tokens per rank: payload per dispatch (all ranks) bf16 "
            f"{wide / 2**20:.2f} MiB, fp8 {narrow / 2**20:.2f} MiB ({narrow / wide:.3f}); "
            f"the fixed capacity sends {int(blocks.sum())} rows a rank a hop whatever the "
            f"routing (bf16 {int(blocks.sum()) * wire[None] * comm.size / 2**20:.2f} MiB, "
            f"fp8 {int(blocks.sum()) * wire['fp8'] * comm.size / 2**20:.2f} MiB on the wire)")
        base = {kind: float(np.median(times[f"counted bf16 {kind}"])) for kind in
                ("dispatch", "pair")}
        for name, seconds in times.items():
            kind = name.rsplit(" ", 1)[1]
            median = float(np.median(seconds))
            rows.append({"tokens": count, "contender": name, "seconds": median,
                         "ratio_to_counted_bf16": median / base[kind],
                         "payload_bytes": narrow if "fp8" in name else wide})
            say(f"{name:>22}: {median * 1e3:9.3f} ms ({median / base[kind]:.2f}x counted "
                f"bf16)", flush=True)
    write_json(json_path, rows, comm.rank)
    comm.free()
