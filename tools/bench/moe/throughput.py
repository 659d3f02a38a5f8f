"""``moe throughput``: dispatch + combine at training sizes, commlib (flat,
two-hop) against the every-pair mpi4py dispatcher."""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.moe.baselines import megatron_style
from commlib.tools.bench.timing import interleaved, json_option, write_json


def commlib_path(dispatcher: moe.Dispatcher) -> Callable:
    def run(x, experts, weights):
        expert_x, handle = dispatcher.dispatch(x, experts, weights)
        y = dispatcher.combine(expert_x, handle)
        run.stats = handle.stats
        return y, int(handle.stats.traffic[dispatcher.comm.rank].sum())
    return run


@click.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", "num_experts", default=64, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--ranks-per-node", type=int, default=None,
              help="Emulate nodes of this many ranks (two-hop needs 2+ nodes).")
@click.option("--iters", default=5, show_default=True)
@json_option
def throughput(tokens: int, hidden: int, num_experts: int, topk: int,
               ranks_per_node: Optional[int], iters: int, json_path: Optional[str]) -> None:
    """Dispatch + combine: commlib (flat, two-hop) vs every-pair mpi4py."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", ranks_per_node=ranks_per_node, abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    experts, weights = moe.route(rng.standard_normal((tokens, num_experts)), topk)
    raw = world.Dup()
    contenders: Dict[str, Callable] = {
        "mpi4py every pair": megatron_style(raw, num_experts),
        "commlib flat": commlib_path(moe.Dispatcher(comm, num_experts)),
    }
    if comm.topology.num_nodes > 1:
        contenders["commlib two-hop"] = commlib_path(moe.Dispatcher(comm, num_experts,
                                                                    hierarchical=True))
    reference, _ = contenders["mpi4py every pair"](x, experts, weights)
    for name, run in contenders.items():
        y, _ = run(x, experts, weights)
        if not np.allclose(y, reference, atol=1e-4):
            raise AssertionError(f"{name} disagrees with the every-pair reference")
    times = interleaved(world, {name: functools.partial(run, x, experts, weights)
                                for name, run in contenders.items()}, iters, warmup=0)
    say(f"bench_moe throughput: {comm.size} ranks, {comm.topology.num_nodes} nodes; {tokens} "
        f"tokens x {hidden} float32 per rank, {num_experts} experts, top-{topk}; identity "
        f"experts")
    rows = []
    base = float(np.median(times["mpi4py every pair"]))
    for name, run in contenders.items():
        seconds = float(np.median(times[name]))
        _, sent = run(x, experts, weights)
        sent_total = world.allreduce(sent, op=MPI.SUM)
        row = {"contender": name, "seconds": seconds, "ratio_to_every_pair": seconds / base,
               "tokens_per_s": tokens * comm.size / seconds,
               "bytes_per_token": sent_total / (tokens * comm.size)}
        if hasattr(run, "stats"):
            row.update(inter_node_bytes=run.stats.inter_node_bytes,
                       intra_node_bytes=run.stats.intra_node_bytes,
                       imbalance=run.stats.imbalance)
        rows.append(row)
        nodes = (f", inter-node {row['inter_node_bytes'] / 2**20:.1f} MiB, intra-node "
                 f"{row['intra_node_bytes'] / 2**20:.1f} MiB" if "inter_node_bytes" in row else "")
        say(f"{name:>18}: {seconds * 1e3:8.1f} ms ({row['ratio_to_every_pair']:.2f}x), "
            f"{row['tokens_per_s'] / 1e3:7.1f} k tokens/s, {row['bytes_per_token']:7.0f} "
            f"payload B/token dispatched{nodes}", flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()
