"""Benchmark: commlib's ``alltoallv`` against raw mpi4py and torch gloo.

    mpiexec -n 2 python -m commlib.tools.bench.alltoallv [--json rows.json]

Speed in commlib is a ratio against baselines measured in the same process
at the same moment (docs/benchmarks.md), so the contenders
are interleaved (commlib, mpi4py, gloo, commlib, ...) and share whatever
noise the machine has. Every timed call starts right after a Barrier, and
an iteration's time is the slowest rank's (a collective is done when its
last rank is), so the per-rank times are reduced with MAX; the median over
iterations is reported. Untimed calls before each timed one make these
steady-state times (see ``timing.time_interleaved``), like those of the OSU and
nccl-tests loops, not the cost of a first call after other work.

Each contender does the whole job a caller has: given rows and per-rank send
counts, learn the receive counts, allocate the output and move the data.

1. commlib: ``comm.alltoallv(x, send_counts)`` (counts exchanged inside).
2. mpi4py by hand: ``Alltoall`` of int64 counts, displacements, ``np.empty``,
   ``Alltoallv`` in ``MPI.BYTE`` on its own ``COMM_WORLD.Dup()``.
3. torch gloo: ``all_to_all_single`` of the counts, then of the rows with
   split sizes. Gloo meets over TCP on 127.0.0.1, so it runs on one host only.

A row is 256 float32 (1 KiB), so 1 KiB per rank is one row. Two count
patterns: ``uniform`` (equal rows to every rank) and ``skewed`` (each rank
sends Zipf-like shares, most to one seeded destination, as a router with a
hot expert would; same total bytes per rank).
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import click
import mpi4py
import numpy as np
from mpi4py import MPI

import commlib
from commlib.tools.bench.timing import auto_iters, time_interleaved, write_json
from commlib.tools.bench.workload import (
    ROW_BYTES,
    ROW_FLOATS,
    Exchange,
    format_size,
    make_rows,
    mpi4py_exchange,
    parse_size,
    send_counts,
)

SIZE_FACTOR = 4
PATTERNS = ("uniform", "skewed")
QUARTILES = (25, 50, 75)

@dataclass
class Row:
    """One line of the result table (times in microseconds, medians over iterations)."""

    pattern: str
    bytes_per_rank: int
    ranks: int
    iters: int
    commlib_us: float
    mpi4py_us: float
    gloo_us: Optional[float]
    commlib_over_mpi4py: float
    gloo_over_commlib: Optional[float]
    quartiles_us: Dict[str, List[float]]   # contender -> [25th, 50th, 75th percentile]


# -- sizes and counts ---------------------------------------------------------
def size_ladder(min_bytes: int, max_bytes: int) -> List[int]:
    """min_bytes, min_bytes*4, ... up to max_bytes (included even off the ladder)."""
    sizes = [min_bytes]
    while sizes[-1] * SIZE_FACTOR <= max_bytes:
        sizes.append(sizes[-1] * SIZE_FACTOR)
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


# -- contenders ---------------------------------------------------------------
def commlib_exchange(comm: commlib.Communicator) -> Exchange:
    def exchange(x, counts):
        return comm.alltoallv(x, counts)
    return exchange


def gloo_exchange(world: MPI.Comm) -> Tuple[Optional[Exchange], str]:
    """(the gloo contender, its version) or (None, why it is skipped). Collective."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as error:
        return None, f"torch is not importable ({error}); gloo skipped"
    torch.set_num_threads(1)  # one core per rank: no intra-op threads competing with MPI
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = world.bcast(_free_port() if world.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())

    def exchange(x, counts):
        send = torch.from_numpy(counts)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        recv_list = recv.tolist()
        out = torch.empty((sum(recv_list),) + tuple(x.shape[1:]), dtype=torch.float32)
        dist.all_to_all_single(out, torch.from_numpy(x), output_split_sizes=recv_list,
                               input_split_sizes=counts.tolist())
        return out.numpy(), recv.numpy()
    return exchange, f"torch {torch.__version__} gloo"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- measuring ----------------------------------------------------------------
def verify(contenders: Dict[str, Exchange], x: np.ndarray, counts: np.ndarray,
           label: str) -> None:
    """Every contender must deliver mpi4py's bytes and counts. A wrong result
    makes the timings meaningless, so a mismatch aborts the whole job."""
    want, want_counts = contenders["mpi4py"](x, counts)
    for name, exchange in contenders.items():
        got, got_counts = exchange(x, counts)
        if not (np.array_equal(got_counts, want_counts) and got.shape == want.shape
                and np.array_equal(got.view(np.uint8), want.view(np.uint8))):
            _abort(f"{label}: {name} disagrees with raw mpi4py on rank "
                   f"{MPI.COMM_WORLD.Get_rank()} (recv counts {np.asarray(got_counts).tolist()} "
                   f"vs {want_counts.tolist()}, shape {got.shape} vs {want.shape})")


def measure(contenders: Dict[str, Exchange], pattern: str, nbytes: int, seed: int,
            iters: Optional[int], warmup: int, primers: int, budget: float,
            world: MPI.Comm) -> Row:
    """One table row: verify once, warm up, then time ``iters`` (or enough
    for ``budget`` seconds) interleaved iterations."""
    rank, size = world.Get_rank(), world.Get_size()
    rows = nbytes // ROW_BYTES
    counts = send_counts(pattern, rows, size, rank, seed)
    x = make_rows(rows, rank)
    verify(contenders, x, counts, f"{pattern} {format_size(nbytes)}")
    exchanges = list(contenders.values())
    warm = time_interleaved(exchanges, x, counts, warmup, primers, world)
    n = iters if iters is not None else auto_iters(warm, primers, budget)
    seconds = time_interleaved(exchanges, x, counts, n, primers, world)
    us = dict(zip(contenders, np.percentile(seconds * 1e6, QUARTILES, axis=0).T.tolist()))
    median = {name: q[1] for name, q in us.items()}
    gloo = median.get("gloo")
    return Row(pattern, nbytes, size, n, median["commlib"], median["mpi4py"], gloo,
               median["commlib"] / median["mpi4py"],
               gloo / median["commlib"] if gloo is not None else None, us)


# -- reporting ----------------------------------------------------------------
def format_table(rows: Sequence[Row]) -> str:
    header = (f"{'pattern':<8} {'bytes/rank':>10} {'iters':>5} {'commlib us':>11} "
              f"{'mpi4py us':>11} {'gloo us':>11} {'commlib/mpi4py':>14} {'gloo/commlib':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        gloo = f"{r.gloo_us:11.1f}" if r.gloo_us is not None else f"{'-':>11}"
        ratio = f"{r.gloo_over_commlib:12.2f}" if r.gloo_over_commlib is not None else f"{'-':>12}"
        lines.append(f"{r.pattern:<8} {format_size(r.bytes_per_rank):>10} {r.iters:5d} "
                     f"{r.commlib_us:11.1f} {r.mpi4py_us:11.1f} {gloo} "
                     f"{r.commlib_over_mpi4py:14.2f} {ratio}")
    return "\n".join(lines)


def describe_skew(world: MPI.Comm, seed: int) -> str:
    """Each rank's skewed send shares, so a reader can see where the hot spots are."""
    size = world.Get_size()
    shares = [send_counts("skewed", 10000, size, r, seed) / 100 for r in range(size)]
    return "skewed send shares (%), row = sender:\n" + "\n".join(
        f"  rank {r}: " + " ".join(f"{s:5.1f}" for s in row) for r, row in enumerate(shares))


def _abort(message: str) -> None:
    """Print and end every rank: a lone exception would leave the peers hung
    in the next collective (measured under plain mpi4py: docs/reliability.md)."""
    print(f"bench_alltoallv: ERROR: {message}", file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(1)


def _size_option(ctx, param, value) -> int:
    try:
        nbytes = parse_size(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    if nbytes < ROW_BYTES or nbytes % ROW_BYTES:
        raise click.BadParameter(f"must be a positive multiple of one row ({ROW_BYTES} bytes)")
    return nbytes


def _patterns_option(ctx, param, value) -> List[str]:
    names = [p.strip() for p in value.split(",") if p.strip()]
    unknown = sorted(set(names) - set(PATTERNS))
    if unknown or not names:
        raise click.BadParameter(f"choose from {','.join(PATTERNS)}, got {value!r}")
    return names


@click.command()
@click.option("--min-bytes", default="1KiB", show_default=True, callback=_size_option,
              help="Smallest message: bytes each rank sends in total.")
@click.option("--max-bytes", default="64MiB", show_default=True, callback=_size_option,
              help="Largest message; sizes grow by 4x from --min-bytes.")
@click.option("--iters", type=click.IntRange(min=1), default=None,
              help="Timed iterations per size [default: enough for --seconds].")
@click.option("--warmup", type=click.IntRange(min=1), default=3, show_default=True,
              help="Untimed iterations per size (they also size the auto --iters).")
@click.option("--primers", type=click.IntRange(min=0), default=3, show_default=True,
              help="Untimed calls of a contender right before each of its timed calls.")
@click.option("--seconds", type=click.FloatRange(min=0.0), default=1.0, show_default=True,
              help="Time budget per size and pattern when --iters is not given.")
@click.option("--patterns", default=",".join(PATTERNS), show_default=True,
              callback=_patterns_option, help="Comma-separated count patterns.")
@click.option("--seed", default=0, show_default=True, help="Seed of the skewed pattern.")
@click.option("--no-gloo", is_flag=True,
              help="Leave gloo out; its calls slow the MPI calls after them on a small "
                   "machine, so commlib/mpi4py is cleanest without it.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the rows (with quartiles) to this JSON file (rank 0).")
def main(min_bytes: int, max_bytes: int, iters: Optional[int], warmup: int, primers: int,
         seconds: float, patterns: List[str], seed: int, no_gloo: bool,
         json_path: Optional[str]) -> None:
    """Time commlib alltoallv against raw mpi4py and torch gloo; run under mpiexec."""
    if min_bytes > max_bytes:
        raise click.BadParameter("--min-bytes is larger than --max-bytes")
    try:
        benchmark(min_bytes, max_bytes, iters, warmup, primers, seconds, patterns, seed,
                  not no_gloo, json_path)
    except Exception:
        _abort(f"rank {MPI.COMM_WORLD.Get_rank()}:\n{traceback.format_exc()}")


def benchmark(min_bytes: int, max_bytes: int, iters: Optional[int], warmup: int,
              primers: int, seconds: float, patterns: Sequence[str], seed: int,
              with_gloo: bool, json_path: Optional[str]) -> List[Row]:
    """The benchmark proper; returns the rows (on every rank)."""
    world = MPI.COMM_WORLD
    say = print if world.Get_rank() == 0 else (lambda *a, **k: None)
    comm = commlib.init(backend="mpi")
    raw = world.Dup()
    contenders: Dict[str, Exchange] = {"commlib": commlib_exchange(comm),
                                       "mpi4py": mpi4py_exchange(raw)}
    gloo, gloo_note = gloo_exchange(world) if with_gloo else (None, "gloo left out")
    if gloo is not None:
        contenders["gloo"] = gloo
    mpi = " ".join(MPI.Get_library_version().split()[:3])
    say(f"alltoallv benchmark: {world.Get_size()} ranks, {mpi}, mpi4py {mpi4py.__version__}, "
        f"{gloo_note}")
    say(f"rows of {ROW_FLOATS} float32 ({ROW_BYTES} B); median over iterations of the "
        f"slowest rank's time per call; contenders interleaved")
    if "skewed" in patterns:
        say(describe_skew(world, seed))
    results = []
    for pattern in patterns:
        for nbytes in size_ladder(min_bytes, max_bytes):
            results.append(measure(contenders, pattern, nbytes, seed, iters, warmup,
                                   primers, seconds, world))
            say(format_table(results[-1:]).splitlines()[-1], flush=True)
    say("\n" + format_table(results))
    meta = {"ranks": world.Get_size(), "mpi": mpi, "mpi4py": mpi4py.__version__,
            "gloo": gloo_note, "row_bytes": ROW_BYTES, "seed": seed, "primers": primers}
    write_json(json_path, {"meta": meta, "rows": [asdict(r) for r in results]},
               world.Get_rank())
    if gloo is not None:
        import torch.distributed as dist
        dist.destroy_process_group()
    raw.Free()
    comm.free()
    return results


if __name__ == "__main__":
    main()
