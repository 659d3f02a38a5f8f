"""``commlib diag alltoall``: nccl-tests' alltoall_perf (and alltoallv_perf)
for ``comm.alltoallv``: the command, its sweep, one row per size, timed and
checked, and the parts of each size inside and between hosts."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

import click
import numpy as np
from click.core import ParameterSource

import commlib
from commlib.tools.diag.blame import (
    SLOW_FACTOR,
    SlowLinks,
    attribute_slow_links,
    link_kinds,
    slow_link_lines,
    time_links,
)
from commlib.tools.diag.plot import plot_busbw
from commlib.tools.diag.sweep import Sweep, sweep_options
from commlib.tools.diag.table import (
    RankTime,
    Row,
    bus_bandwidth,
    format_row,
    host_part_lines,
    per_rank_lines,
    table_header,
)
from commlib.tools.diag.traffic import (
    PATTERNS,
    Traffic,
    check_traffic,
    count_wrong,
    matrix_sweep,
    rank_bytes,
    read_matrix,
    send_buffer,
)
from commlib.tools.world import describe_topology, plural, world

# show the progress line only once a sweep has run this long
_PROGRESS_AFTER_S = 2.0


@click.command("alltoall")
@sweep_options
@click.option("--pattern", type=click.Choice(PATTERNS), default="uniform", show_default=True,
              help="uniform: equal bytes to every peer; random: seeded Dirichlet split; "
                   "zipf: shares ~ 1/(offset+1)^skew; hotspot: half to rank 0; "
                   "router: a synthetic top-k MoE router.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random patterns (the same on every rank).")
@click.option("--experts", type=click.IntRange(min=1), default=64, show_default=True,
              help="router: experts, a multiple of the world size.")
@click.option("--topk", type=click.IntRange(min=1), default=8, show_default=True,
              help="router: experts chosen per token.")
@click.option("--skew", type=click.FloatRange(min=0), default=None,
              help="zipf: exponent (default 1); router: expert popularity ~ "
                   "1/(r+1)^skew (default 0, uniform).")
@click.option("--spread", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="uniform: 0 splits evenly; 1 gives rank i's peer j a share "
                   "proportional to (j-i) mod P, its distance ahead on the ring, as "
                   "nccl-tests' alltoallv_perf; between, a linear blend. Every rank still "
                   "sends and receives the same.")
@click.option("--matrix", "matrix_path", type=click.Path(exists=True, dir_okay=False),
              help="Send what this P x P text file says instead of a pattern: row i, "
                   "column j = bytes rank i sends to rank j (whitespace or commas, '#' "
                   "comments). One row; -b/-e may be omitted, else equal and at least the "
                   "busiest rank's bytes, as in nccl-tests' alltoallv_perf.")
@click.option("--per-rank", is_flag=True,
              help="After the table, per size: each rank's send and receive bytes, its own "
                   "median time and its algbw.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Also write the rows to this file as a JSON list (rank 0); with "
                   "--slow-links, an object of the rows and the links.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Plot busbw against size to this PNG (rank 0; needs matplotlib).")
@click.option("--slow-links", is_flag=True,
              help=f"After the sweep, time 1 MiB between every pair of ranks, print the "
                   f"rank x rank matrix and name what is slow (over {SLOW_FACTOR:g}x the "
                   f"fastest link of its kind): a host, a rank or a link.")
@click.option("--backend", type=click.Choice(["mpi", "nccl", "auto"]), default="mpi",
              show_default=True,
              help="mpi: host buffers over MPI; nccl: CuPy buffers over NCCL (needs a GPU); "
                   "auto: NCCL where every rank has a GPU.")
@click.pass_context
def alltoall(ctx: click.Context, sweep: Sweep, pattern: str, seed: int, experts: int,
             topk: int, skew: Optional[float], spread: float, matrix_path: Optional[str],
             per_rank: bool, json_path: Optional[str], plot_path: Optional[str],
             slow_links: bool, backend: str) -> None:
    """Time comm.alltoallv from -b to -e bytes per rank and check the data,
    like nccl-tests' alltoall_perf (alltoallv_perf with --spread or --matrix).
    Exits 1 if any element arrived wrong.

    Sizes and bandwidths are those of the busiest rank (the most bytes sent
    or received), times those of each iteration's slowest rank. When ranks
    share nodes and span several, each size's bytes inside nodes and between
    them are also sent apart, and their bandwidths reported after the table.

    On rank 0, a progress line is shown on stderr when it is a terminal and
    the sweep has run for more than a couple of seconds.
    """
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise click.BadParameter("plotting needs matplotlib: pip install matplotlib",
                                 param_hint="'--plot'")
    default_skew = 1.0 if pattern == "zipf" else 0.0
    traffic = Traffic(pattern, seed, experts, topk, default_skew if skew is None else skew,
                      spread=spread)
    world_size = _world_size()
    if matrix_path is not None:
        traffic = replace(traffic, matrix=read_matrix(matrix_path, world_size, sweep.dtype))
        sized = any(ctx.get_parameter_source(name) is not ParameterSource.DEFAULT
                    for name in ("minbytes", "maxbytes"))
        sweep = matrix_sweep(sweep, traffic.matrix, sized)
    check_traffic(traffic, world_size)
    with world(backend=backend) as comm:
        rows = _run_sweep(comm, sweep, traffic)
        echo = click.echo if comm.rank == 0 else _silent
        if per_rank:
            echo("\n".join(line for row in rows for line in per_rank_lines(row)))
        links = None
        if slow_links:
            links = attribute_slow_links(time_links(comm), comm.topology)
            echo("\n".join(slow_link_lines(links)))
        if comm.rank == 0:
            _save(rows, json_path, plot_path, comm.size, links)
        wrong = sum(part.wrong or 0 for row in rows for part in (row, row.inside, row.between)
                    if part is not None)
        if wrong:
            echo(f"# FAILED: {wrong} element(s) arrived wrong", err=True)
            ctx.exit(1)


def _run_sweep(comm: commlib.Communicator, sweep: Sweep, traffic: Traffic) -> List[Row]:
    """The header, one row per size (printed as it is known), the average."""
    echo = click.echo if comm.rank == 0 else _silent
    echo(f"# commlib diag alltoall: {plural(comm.size, 'rank')}, "
         f"{describe_topology(comm.topology)}")
    echo(f"{sweep.describe()} pattern: {traffic.describe()}")
    echo(table_header())
    sizes = sweep.sizes()
    progress = Progress(len(sizes), enabled=comm.rank == 0 and sys.stderr.isatty())
    rows = []
    for size in sizes:
        progress.show(size)
        row = replace(_alltoall_row(comm, size, sweep, traffic),
                      **_host_parts(comm, size, sweep, traffic))
        progress.clear()
        echo(format_row(row))
        rows.append(row)
    echo(f"# Avg bus bandwidth : {np.mean([row.busbw for row in rows]):.3f}")
    if any(row.inside is not None for row in rows):
        echo("\n".join(host_part_lines(rows)))
    return rows


def _host_parts(comm: commlib.Communicator, size: int, sweep: Sweep,
                traffic: Traffic) -> Dict[str, Row]:
    """The size's bytes to peers on the same host and to peers on other hosts,
    each sent alone (so that the slower kind does not hide the faster), as
    rows by kind; none where a kind carries nothing (one node, one rank per
    host), since the other would then be the whole exchange again."""
    sizes = traffic.counts(size, comm.size, sweep.dtype) * sweep.dtype.itemsize
    parts = {kind: sizes * mask for kind, mask in link_kinds(comm.topology).items()}
    if not all(part.any() for part in parts.values()):
        return {}
    return {kind: _alltoall_row(comm, size, sweep, replace(traffic, matrix=part))
            for kind, part in parts.items()}


def _save(rows: List[Row], json_path: Optional[str], plot_path: Optional[str],
          nranks: int, links: Optional[SlowLinks] = None) -> None:
    """Write the rows where --json and --plot asked (rank 0 only); with the
    links of --slow-links, the JSON is an object of both."""
    if json_path is not None:
        report = [row.as_json() for row in rows]
        with open(json_path, "w") as file:
            json.dump(report if links is None else {"rows": report, "links": links.as_json()},
                      file, indent=1)
    if plot_path is not None:
        plot_busbw(rows, plot_path, nranks)


def _world_size() -> int:
    """The launch's size, read without communicating, so usage errors that
    depend on it are raised identically on every rank."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def _silent(*_args, **_kwargs) -> None:
    """Stands in for ``click.echo`` on ranks other than 0."""


def _alltoall_row(comm: commlib.Communicator, size: int, sweep: Sweep,
                  traffic: Traffic) -> Row:
    """Run, time and check one size, and rate it by the busiest rank over
    the slowest time, as nccl-tests' alltoallv_perf does."""
    dtype = sweep.dtype
    matrix = traffic.counts(size, comm.size, dtype)
    send_counts, recv_counts = matrix[comm.rank], matrix[:, comm.rank]
    send = on_device(send_buffer(comm.rank, send_counts, dtype), comm)
    own, received = time_alltoallv(comm, send, send_counts, recv_counts, sweep.iters,
                                   sweep.warmup_iters)
    received = on_host(received, dtype)
    wrong = None
    if sweep.check:
        local = np.array([count_wrong(received, comm.rank, recv_counts)], dtype=np.int64)
        wrong = int(comm.allreduce(local, op="sum")[0])
    # reduced once, after the loop: each iteration's slowest rank, with no
    # collective between iterations
    times = comm.allreduce(own, op="max")
    medians = comm.allgather(np.array([np.median(own)]))
    sizes = matrix * dtype.itemsize
    ranks = tuple(RankTime(rank, int(sizes[rank].sum()), int(sizes[:, rank].sum()),
                           float(medians[rank])) for rank in range(comm.size))
    loads = rank_bytes(sizes)
    busiest = int(np.argmax(loads))  # the first, on a tie
    nbytes = int(loads[busiest])
    algbw = nbytes / times.mean() / 1e9
    p50, p99 = np.percentile(times, [50, 99])
    return Row(nbytes, nbytes // dtype.itemsize, dtype.name, float(times.mean()),
               float(times.min()), float(times.max()), float(p50), float(p99), algbw,
               bus_bandwidth(algbw, comm.size), wrong, busiest, ranks)


def on_device(send: np.ndarray, comm: commlib.Communicator):
    """The send buffer where the backend moves data: unchanged for MPI, a
    CuPy copy for NCCL (as raw same-sized integers: CuPy has no bfloat16)."""
    if comm.backend != "nccl":
        return send
    import cupy
    return cupy.asarray(send.view(f"u{send.dtype.itemsize}"))


def on_host(received, dtype: np.dtype) -> np.ndarray:
    """What arrived, as a NumPy array of ``dtype``, for the check."""
    if hasattr(received, "get"):
        return received.get().view(dtype)
    return received


def time_alltoallv(comm: commlib.Communicator, send: np.ndarray, send_counts: np.ndarray,
                   recv_counts: np.ndarray, iters: int,
                   warmup_iters: int) -> Tuple[np.ndarray, np.ndarray]:
    """(seconds of each timed iteration on this rank, the last result).
    Every iteration starts at a barrier, so it times one exchange and not
    the skew between ranks."""
    for _ in range(warmup_iters):
        comm.alltoallv(send, send_counts, recv_counts)
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        comm.barrier()
        start = time.perf_counter()
        received, _ = comm.alltoallv(send, send_counts, recv_counts)
        times[i] = time.perf_counter() - start
    return times, received


class Progress:
    """A one-line ``[i/n] size`` status on stderr, overwritten in place and
    cleared before each table row, so it never mixes into the table. Shown
    only when enabled (rank 0, stderr a terminal) and once the sweep has run
    for ``_PROGRESS_AFTER_S``: short sweeps stay quiet."""

    def __init__(self, total: int, enabled: bool) -> None:
        self._total, self._enabled = total, enabled
        self._done, self._start, self._shown = 0, time.perf_counter(), False

    def show(self, size: int) -> None:
        """Announce the size about to run."""
        self._done += 1
        if self._enabled and time.perf_counter() - self._start > _PROGRESS_AFTER_S:
            self._write(f"\r[{self._done}/{self._total}] {size} B ...")
            self._shown = True

    def clear(self) -> None:
        """Erase the status line, if one is on screen."""
        if self._shown:
            self._write("\r\033[K")
            self._shown = False

    @staticmethod
    def _write(text: str) -> None:
        """Straight to stderr: click.echo would strip the erase-line code."""
        sys.stderr.write(text)
        sys.stderr.flush()
