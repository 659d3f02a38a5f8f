"""Ring Attention on this machine: strong scaling, exposed communication,
causal load balance and peak memory, each as a ratio against a baseline run
in the same launch.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.ring scaling overlap balance
    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m commlib.tools.bench.ring overlap memory

One BLAS thread per rank (the environment variable must be set before NumPy
loads), so that P ranks on P cores compare fairly with one rank on one core.

- scaling: the global problem on all ranks against the same problem on one
  rank alone (every rank runs it at once on its own core, via a size-1
  sub-communicator): efficiency = t_one / (P * t_ring).
- overlap: ring_attention against the same blockwise compute with the
  communication skipped (a stand-in communicator that hands each rank its own
  K/V as every step's block): exposed communication = t_ring / t_compute.
- balance: causal zigzag against causal contiguous (the slowest rank's time).
- memory: tracemalloc's peak during a forward pass against the need: local
  Q, K, V, O, two K/V buffers and one score tile.
"""

from __future__ import annotations

import functools
import tracemalloc
from typing import Callable, Dict, List, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import ring
from commlib.kernels.tiled import choose_tile
from commlib.tools.bench.timing import best_slowest, json_option, slowest, write_json


class _NoTransfer:
    """Stands in for a Communicator in ring_attention: the same schedule and
    compute, every step's block is this rank's own K/V, nothing is sent."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def agree(self, *_args, **_kwargs) -> None:
        pass

    def ring_shift_async(self, block):
        return _Ready(block)


class _Ready:
    def __init__(self, block):
        self._block = block

    def wait(self):
        return self._block


def _inputs(seq_local: int, heads: int, dim: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, seq_local, heads, dim), dtype=np.float32)
            for _ in range(3)]


def scaling(comm, world, seq: int, heads: int, dim: int, repeats: int) -> List[dict]:
    """Efficiency of the ring against one rank, non-causal and causal zigzag."""
    alone = comm.split(comm.rank)  # a world of one per rank
    rows = []
    for causal, layout in ((False, "contiguous"), (True, "zigzag")):
        q, k, v = _inputs(seq // comm.size, heads, dim, comm.rank)
        fq, fk, fv = _inputs(seq, heads, dim, comm.rank)
        t_ring = best_slowest(world, functools.partial(ring.ring_attention, q, k, v, comm,
                                                       layout=layout, causal=causal), repeats)
        t_one = best_slowest(world, functools.partial(ring.ring_attention, fq, fk, fv, alone,
                                                      layout=layout, causal=causal), repeats)
        rows.append({"test": "scaling", "seq": seq, "causal": causal, "layout": layout,
                     "ranks": comm.size, "t_one_s": t_one, "t_ring_s": t_ring,
                     "efficiency": t_one / (comm.size * t_ring)})
    alone.free()
    return rows


def overlap(comm, world, seq: int, heads: int, dim: int, repeats: int) -> List[dict]:
    """Ring forward against the same compute without communication."""
    q, k, v = _inputs(seq // comm.size, heads, dim, comm.rank)
    stand_in = _NoTransfer(comm.rank, comm.size)
    t_ring = best_slowest(world, lambda: ring.ring_attention(
        q, k, v, comm, layout="contiguous", causal=False), repeats)
    t_compute = best_slowest(world, lambda: ring.ring_attention(
        q, k, v, stand_in, layout="contiguous", causal=False), repeats)
    return [{"test": "overlap", "seq": seq, "ranks": comm.size, "t_ring_s": t_ring,
             "t_compute_s": t_compute, "exposed_ratio": t_ring / t_compute}]


def balance(comm, world, seq: int, heads: int, dim: int, repeats: int) -> List[dict]:
    """Causal zigzag against causal contiguous on the same global problem."""
    q, k, v = _inputs(seq // comm.size, heads, dim, comm.rank)
    times = {layout: best_slowest(world, functools.partial(ring.ring_attention, q, k, v, comm,
                                                           layout=layout, causal=True), repeats)
             for layout in ("contiguous", "zigzag")}
    return [{"test": "balance", "seq": seq, "ranks": comm.size,
             "t_contiguous_s": times["contiguous"], "t_zigzag_s": times["zigzag"],
             "speedup": times["contiguous"] / times["zigzag"]}]


def memory(comm, world, seq: int, heads: int, dim: int, repeats: int) -> List[dict]:
    """Peak traced bytes of a causal zigzag forward against the need."""
    local = seq // comm.size
    tensor = local * heads * dim * 4
    tile = heads * min(choose_tile(1, heads), local) ** 2 * 4
    need = 4 * tensor + 2 * (2 * tensor) + tile  # Q K V O, two K/V buffers, a score tile
    tracemalloc.start()
    q, k, v = _inputs(local, heads, dim, comm.rank)
    t = slowest(world, lambda: ring.ring_attention(q, k, v, comm, layout="zigzag", causal=True))
    peak = world.allreduce(tracemalloc.get_traced_memory()[1], op=MPI.MAX)
    tracemalloc.stop()
    return [{"test": "memory", "seq": seq, "ranks": comm.size, "need_bytes": need,
             "peak_bytes": peak, "peak_over_need": peak / need, "t_s": t}]


TESTS: Dict[str, Callable] = {"scaling": scaling, "overlap": overlap, "balance": balance,
                              "memory": memory}
DEFAULT_SEQ = {"scaling": 4096, "overlap": 16384, "balance": 8192, "memory": 32768}


def describe(row: dict) -> str:
    t = row["test"]
    if t == "scaling":
        return (f"scaling  seq {row['seq']} causal={row['causal']} {row['layout']}: one rank "
                f"{row['t_one_s']:.2f} s, {row['ranks']} ranks {row['t_ring_s']:.2f} s, "
                f"efficiency {row['efficiency']:.2f} (target >= 0.8)")
    if t == "overlap":
        return (f"overlap  seq {row['seq']}: ring {row['t_ring_s']:.2f} s, compute only "
                f"{row['t_compute_s']:.2f} s, ratio {row['exposed_ratio']:.3f} (target <= 1.25)")
    if t == "balance":
        return (f"balance  seq {row['seq']} causal: contiguous {row['t_contiguous_s']:.2f} s, "
                f"zigzag {row['t_zigzag_s']:.2f} s, speedup {row['speedup']:.2f} "
                f"(target >= 1.3)")
    return (f"memory   seq {row['seq']}: peak {row['peak_bytes'] / 2**20:.1f} MiB per rank, "
            f"need {row['need_bytes'] / 2**20:.1f} MiB, ratio {row['peak_over_need']:.2f} "
            f"(target <= 2)")


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(sorted(TESTS)))
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--seq", type=int, default=None, help="Global sequence length "
              "[default: 4096 scaling, 16384 overlap, 8192 balance, 32768 memory].")
@click.option("--repeats", default=2, show_default=True, help="Best of this many runs.")
@json_option
def main(tests, heads: int, head_dim: int, seq: Optional[int], repeats: int,
         json_path: Optional[str]) -> None:
    """Ring Attention benchmarks; run under mpiexec (see the module docstring)."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_ring: {comm.size} ranks, heads {heads}, head_dim {head_dim}, float32, "
        f"batch 1, tile {choose_tile(1, heads)}")
    rows: List[dict] = []
    for name in tests or sorted(TESTS):
        for row in TESTS[name](comm, world, seq or DEFAULT_SEQ[name], heads, head_dim,
                               repeats):
            rows.append(row)
            say(describe(row), flush=True)
    write_json(json_path, rows, comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
