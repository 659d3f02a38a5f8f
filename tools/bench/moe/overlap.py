"""``moe overlap``: two micro-batches with an expert MLP between dispatch
and combine, sequential against overlapped through the async handles."""

from __future__ import annotations

from typing import Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.moe.workload import torch_routing
from commlib.tools.bench.timing import interleaved, json_option, write_json


@click.command()
@click.option("--tokens", default=1024, show_default=True, help="Tokens per micro-batch.")
@click.option("--hidden", default=2048, show_default=True)
@click.option("--ffn", default=1024, show_default=True, help="The expert MLP's inner width.")
@click.option("--experts", "num_experts", default=16, show_default=True)
@click.option("--topk", default=4, show_default=True)
@click.option("--fixed", is_flag=True, help="The fixed-capacity mode.")
@click.option("--iters", default=5, show_default=True)
@json_option
def overlap(tokens: int, hidden: int, ffn: int, num_experts: int, topk: int, fixed: bool,
            iters: int, json_path: Optional[str]) -> None:
    """Two micro-batches, an expert MLP (torch float32, one thread) between
    dispatch and combine. Sequential: A's dispatch, MLP, combine, then B's.
    Overlapped (DualPipe's pairing): both dispatches started, A's MLP while
    B's dispatch is in flight, A's combine started before B's MLP. Hidden =
    (sequential - overlapped) / (sequential - MLP alone)."""
    import torch

    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    torch.set_num_threads(1)
    local = num_experts // comm.size
    generator = torch.Generator().manual_seed(comm.rank)
    w_in = torch.randn(local, hidden, ffn, generator=generator) / hidden ** 0.5
    w_out = torch.randn(local, ffn, hidden, generator=generator) / ffn ** 0.5
    batches = []
    for seed in (0, 1):
        x, experts, weights = torch_routing(comm, tokens, hidden, num_experts, topk, seed)
        batches.append((x.float(), experts, weights))
    d = moe.Dispatcher(comm, num_experts, max_tokens_per_rank=tokens if fixed else None)

    def mlp(expert_x, handle):
        if expert_x.ndim == 3:  # fixed capacity: every slot, padding included
            return torch.bmm(torch.relu(torch.bmm(expert_x, w_in)), w_out)
        chunks = torch.split(expert_x, handle.tokens_per_expert.tolist())
        return torch.cat([torch.relu(c @ w_in[e]) @ w_out[e] for e, c in enumerate(chunks)])

    dispatched = [d.dispatch(*b) for b in batches]

    def sequential():
        for batch in batches:
            expert_x, handle = d.dispatch(*batch)
            d.combine(mlp(expert_x, handle), handle)

    def overlapped():
        started = [d.dispatch_async(*b) for b in batches]
        first = started[0].wait()
        combining = d.combine_async(mlp(*first), first[1])  # B's dispatch in flight
        second = started[1].wait()
        last = d.combine_async(mlp(*second), second[1])  # A's combine in flight
        combining.wait()
        last.wait()

    def compute_alone():
        for expert_x, handle in dispatched:
            mlp(expert_x, handle)
    times = {name: float(np.median(t)) for name, t in interleaved(
        world, {"sequential": sequential, "overlapped": overlapped,
                "expert MLP alone": compute_alone}, iters).items()}
    communication = times["sequential"] - times["expert MLP alone"]
    hidden_fraction = (times["sequential"] - times["overlapped"]) / communication
    say(f"bench_moe overlap: {comm.size} ranks; 2 micro-batches of {tokens} tokens x {hidden} "
        f"float32, {num_experts} experts top-{topk}, MLP {hidden}->{ffn}->{hidden}; "
        f"{'fixed capacity' if fixed else 'counted'}")
    for name, seconds in times.items():
        say(f"{name:>18}: {seconds * 1e3:8.1f} ms")
    say(f"communication (sequential - MLP): {communication * 1e3:.1f} ms; hidden by the "
        f"overlap: {hidden_fraction * 100:.0f}%")
    write_json(json_path, [dict(times, communication=communication,
                                hidden_fraction=hidden_fraction, fixed=fixed)], comm.rank)
    comm.free()
