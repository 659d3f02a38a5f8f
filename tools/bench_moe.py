"""MoE dispatch + combine on this machine, against a hand-written mpi4py
dispatcher that sends every token-expert pair (the Megatron-style path), in
the same launch, interleaved.

    mpiexec -n 4 python -m commlib.tools.bench_moe --ranks-per-node 2

Experts are the identity, so the times are the communication path: routing
layout, permutation, all-to-alls, expansion, weighted combine. Reported per
contender: time per dispatch+combine (slowest rank, median), tokens/s over
all ranks, payload bytes sent per token, and (for commlib) bytes between and
inside nodes.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Callable, Dict, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe


def megatron_style(world: MPI.Comm, num_experts: int) -> Callable:
    """Every (token, expert) pair is its own row on the wire: permute by
    destination, count exchange, Alltoallv there and back, weighted sum."""
    size = world.Get_size()
    per_rank = num_experts // size

    def run(x, experts, weights):
        tokens, k = experts.shape
        pair_token = np.repeat(np.arange(tokens), k)
        dest = experts.reshape(-1) // per_rank
        order = np.argsort(dest, kind="stable")
        send = x[pair_token[order]]
        counts = np.bincount(dest, minlength=size).astype(np.int64)
        recv_counts = np.empty_like(counts)
        world.Alltoall(counts, recv_counts)
        row = x.shape[1] * x.itemsize
        received = np.empty((int(recv_counts.sum()), x.shape[1]), x.dtype)
        world.Alltoallv([send, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE],
                        [received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE])
        back = np.empty_like(send)  # identity experts: the rows go straight back
        world.Alltoallv([received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE],
                        [back, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE])
        per_pair = np.empty_like(back)
        per_pair[order] = back
        weighted = per_pair.reshape(tokens, k, -1) * weights[..., None]
        return weighted.sum(axis=1), int(send.nbytes)
    return run


def commlib_path(dispatcher: moe.Dispatcher) -> Callable:
    def run(x, experts, weights):
        expert_x, handle = dispatcher.dispatch(x, experts, weights)
        y = dispatcher.combine(expert_x, handle)
        run.stats = handle.stats
        return y, int(handle.stats.traffic[dispatcher.comm.rank].sum())
    return run


def _slowest(world, call) -> float:
    world.Barrier()
    start = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


@click.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", "num_experts", default=64, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--ranks-per-node", type=int, default=None,
              help="Emulate nodes of this many ranks (two-hop needs 2+ nodes).")
@click.option("--iters", default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(tokens: int, hidden: int, num_experts: int, topk: int, ranks_per_node: Optional[int],
         iters: int, json_path: Optional[str]) -> None:
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
    times = {name: [] for name in contenders}
    for _ in range(iters):
        for name, run in contenders.items():
            times[name].append(_slowest(world, functools.partial(run, x, experts, weights)))
    say(f"bench_moe: {comm.size} ranks, {comm.topology.num_nodes} nodes; {tokens} tokens x "
        f"{hidden} float32 per rank, {num_experts} experts, top-{topk}; identity experts")
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
    if json_path and comm.rank == 0:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    raw.Free()
    comm.free()


if __name__ == "__main__":
    main()
