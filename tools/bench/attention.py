"""Context-parallel attention against the user's real alternative: torch's
own SDPA in one process on the same cores.

    mpiexec -n 2 python -m commlib.tools.bench.attention            # 2 ranks x 1 thread
    mpiexec -n 1 python -m commlib.tools.bench.attention            # 1 rank  x 1 thread
    mpiexec -n 2 python -m commlib.tools.bench.attention --dtype bfloat16

Forward + backward of causal attention over the global sequence, through
``commlib.bindings.torch`` (Ring with the zigzag layout, Ulysses) with one
thread per rank, against ``torch.nn.functional.scaled_dot_product_attention``
on the unsharded sequence in one process with as many threads as there are
ranks (rank 0 runs it while the others sleep, without spinning). Contenders
are interleaved, best of ``--repeats``; the ratio is commlib's time over
SDPA's, the slowest rank counted.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List

import click
import torch
from mpi4py import MPI

import commlib
from commlib import ring
from commlib.bindings import torch as ct
from commlib.tools.bench.timing import first_rank_alone, idle_barrier

TARGETS = {1: 1.05, 2: 1.10}


def _sdpa_on_rank0(world: MPI.Comm, full: List[torch.Tensor], threads: int) -> float:
    """Seconds of SDPA forward + backward on rank 0 with ``threads`` threads."""
    def timed() -> float:
        torch.set_num_threads(threads)
        q, k, v, dout = (t.transpose(1, 2) for t in full)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        start = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=True, enable_gqa=True).backward(dout)
        elapsed = time.perf_counter() - start
        torch.set_num_threads(1)
        return elapsed
    return first_rank_alone(world, timed)


def _sharded(world: MPI.Comm, attend: Callable, shards: List[torch.Tensor]) -> float:
    """Seconds of the slowest rank for commlib forward + backward."""
    leaves = [t.detach().clone().requires_grad_() for t in shards[:3]]
    idle_barrier(world)
    start = time.perf_counter()
    attend(*leaves).backward(shards[3])
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Global sequence length.")
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=None, type=int, help="KV heads (GQA) [default: heads].")
@click.option("--head-dim", default=64, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default="float32", show_default=True)
@click.option("--repeats", default=3, show_default=True, help="Best of this many runs.")
def main(seq: int, heads: int, kv_heads, head_dim: int, dtype: str, repeats: int) -> None:
    """Ring and Ulysses (torch binding) against single-process torch SDPA."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    size = comm.size
    kind = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, seq, h, head_dim) for h in (heads, kv_heads or heads, kv_heads or heads,
                                             heads)]
    full = [torch.randn(s, generator=gen).to(kind) for s in shapes]
    zigzag = [ring.shard_sequence(t, comm, layout="zigzag") for t in full]
    contiguous = [ring.shard_sequence(t, comm, layout="contiguous") for t in full]
    contenders: Dict[str, Callable[[], float]] = {
        f"torch SDPA, 1 process x {size} threads": lambda: _sdpa_on_rank0(world, full, size),
        "commlib ring (zigzag)": lambda: _sharded(
            world, lambda q, k, v: ct.ring_attention(q, k, v, comm, layout="zigzag",
                                                     causal=True), zigzag),
        "commlib ulysses": lambda: _sharded(
            world, lambda q, k, v: ct.ulysses_attention(q, k, v, comm, layout="contiguous",
                                                     causal=True), contiguous),
    }
    for call in contenders.values():  # warm up: allocators, thread pools
        call()
    best = {name: float("inf") for name in contenders}
    for _ in range(repeats):
        for name, call in contenders.items():
            best[name] = min(best[name], call())
    if comm.rank == 0:
        baseline = next(iter(best.values()))
        print(f"bench_attention: {size} rank(s) x 1 thread vs SDPA with {size} thread(s); "
              f"seq {seq}, heads {heads}, kv heads {kv_heads or heads}, head_dim {head_dim}, "
              f"{dtype}, causal, forward + backward, best of {repeats}")
        for name, seconds in best.items():
            ratio = seconds / baseline
            target = "" if name.startswith("torch") else \
                f"  (target <= {TARGETS.get(size, TARGETS[2]):.2f})"
            print(f"  {name:<40} {seconds:8.3f} s  ratio {ratio:.3f}{target}")
    comm.free()


if __name__ == "__main__":
    main()
