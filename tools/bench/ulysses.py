"""Ulysses and the planner on this machine, as ratios against baselines run
in the same launch.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.ulysses relayout fused
    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m commlib.tools.bench.ulysses relayout fused planner

- relayout: ``seq_to_head`` of [1, 8192, 16, 128] float32 against the same
  relayout written by hand: NumPy pack, mpi4py ``Alltoall``, NumPy unpack.
- fused: q, k and v relaid in one all-to-all (``seq_to_head_many``) against
  three ``seq_to_head`` calls, on a short (latency-bound) sequence.
- planner: for three shapes (few heads, many heads, GQA) every allowed
  Ulysses x Ring split of ``hybrid_attention`` is timed, and the planner's
  pick is compared with the fastest.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import hybrid, ulysses
from commlib.tools.bench.timing import interleaved_medians, json_option, write_json
from commlib.ulysses.relayout import divisors


def by_hand(world: MPI.Comm, x: np.ndarray) -> np.ndarray:
    """seq_to_head as a user writes it without commlib."""
    size = world.Get_size()
    b, sl, h, d = x.shape
    send = np.ascontiguousarray(x.reshape(b, sl, size, h // size, d).transpose(2, 0, 1, 3, 4))
    received = np.empty_like(send)
    world.Alltoall(send, received)
    return np.ascontiguousarray(received.transpose(1, 0, 2, 3, 4)).reshape(
        b, size * sl, h // size, d)


def relayout(comm, world, repeats: int) -> List[dict]:
    shape = (1, 8192 // comm.size, 16, 128)
    x = np.random.default_rng(comm.rank).standard_normal(shape, dtype=np.float32)
    raw = world.Dup()
    if not np.array_equal(ulysses.seq_to_head(x, comm), by_hand(raw, x)):
        raise AssertionError("seq_to_head differs from the hand-written relayout")
    t_lib, t_hand = interleaved_medians(world, [lambda: ulysses.seq_to_head(x, comm),
                                                lambda: by_hand(raw, x)], repeats)
    raw.Free()
    return [{"test": "relayout", "ranks": comm.size, "shape": [1, 8192, 16, 128],
             "commlib_s": t_lib, "by_hand_s": t_hand, "ratio": t_lib / t_hand}]


def fused(comm, world, repeats: int) -> List[dict]:
    rows = []
    for seq in (16, 64, 1024):
        rng = np.random.default_rng(comm.rank)
        q = rng.standard_normal((1, seq // comm.size, 16, 64), dtype=np.float32)
        k = rng.standard_normal((1, seq // comm.size, 4, 64), dtype=np.float32) \
            if comm.size <= 4 else q
        v = k.copy()
        t_three, t_one = interleaved_medians(world, [  # sub-millisecond calls: many rounds
            lambda q=q, k=k, v=v: [ulysses.seq_to_head(t, comm) for t in (q, k, v)],
            functools.partial(ulysses.seq_to_head_many, [q, k, v], comm)], 40 * repeats)
        rows.append({"test": "fused", "ranks": comm.size, "seq": seq, "three_calls_s": t_three,
                     "fused_s": t_one, "speedup": t_three / t_one})
    return rows


SHAPES = {"few heads": (4, 4), "many heads": (16, 16), "GQA": (16, 2)}


def planner(comm, world, repeats: int, seq: int = 4096, head_dim: int = 64) -> List[dict]:
    rows = []
    for name, (heads, kv_heads) in SHAPES.items():
        rng = np.random.default_rng(comm.rank)
        q = rng.standard_normal((1, seq // comm.size, heads, head_dim), dtype=np.float32)
        k = rng.standard_normal((1, seq // comm.size, kv_heads, head_dim), dtype=np.float32)
        v = k.copy()
        pick = hybrid.plan(comm, seq, heads, kv_heads, head_dim, itemsize=4, causal=False,
                           layout="contiguous", methods=("ring",))
        allowed = [c.ulysses_size for c in pick.candidates]
        times = dict(zip(allowed, interleaved_medians(world, [
            functools.partial(hybrid.hybrid_attention, q, k, v, comm, u, layout="contiguous",
                              causal=False)
            for u in allowed],
            repeats)))
        fastest = min(times, key=times.get)
        rows.append({"test": "planner", "shape": name, "ranks": comm.size, "seq": seq,
                     "heads": heads, "kv_heads": kv_heads,
                     "seconds_by_ulysses_size": times, "pick": pick.ulysses_size,
                     "predicted": {c.ulysses_size: c.seconds for c in pick.candidates},
                     "fastest": fastest,
                     "pick_over_fastest": times[pick.ulysses_size] / times[fastest],
                     "explain": pick.explain()})
    return rows


def describe(row: dict) -> str:
    if row["test"] == "relayout":
        return (f"relayout [1, 8192, 16, 128] f32: commlib {row['commlib_s'] * 1e3:.2f} ms, "
                f"by hand {row['by_hand_s'] * 1e3:.2f} ms, ratio {row['ratio']:.3f} "
                f"(target <= 1.10)")
    if row["test"] == "fused":
        return (f"fused q/k/v seq {row['seq']}: three calls {row['three_calls_s'] * 1e3:.2f} ms, "
                f"one {row['fused_s'] * 1e3:.2f} ms, speedup {row['speedup']:.2f} "
                f"(target >= 1.2 when latency-bound)")
    times = ", ".join(f"U{u}xR{comm_size_over(row, u)} {t * 1e3:.0f} ms"
                      for u, t in row["seconds_by_ulysses_size"].items())
    return (f"planner {row['shape']} (h {row['heads']}, kv {row['kv_heads']}, seq {row['seq']}): "
            f"{times}; pick U{row['pick']}, fastest U{row['fastest']}, pick/fastest "
            f"{row['pick_over_fastest']:.3f} (target <= 1.10)")


def comm_size_over(row: dict, u: int) -> int:
    return row["ranks"] // u


TESTS = {"relayout": relayout, "fused": fused, "planner": planner}


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(sorted(TESTS)))
@click.option("--repeats", default=5, show_default=True)
@json_option
def main(tests, repeats: int, json_path: Optional[str]) -> None:
    """Ulysses relayout and planner benchmarks; run under mpiexec."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_ulysses: {comm.size} ranks (of {divisors(comm.size)})")
    rows = []
    for name in tests or sorted(TESTS):
        for row in TESTS[name](comm, world, repeats):
            rows.append(row)
            say(describe(row), flush=True)
    write_json(json_path, rows, comm.rank, default=str)
    comm.free()


if __name__ == "__main__":
    main()
