"""The ``commlib`` command line: what a launch sees, and diagnostics.

It is an MPI program like any other: every rank runs the command, rank 0
prints. ::

    mpiexec -n 4 commlib info
    mpiexec -n 4 commlib diag alltoall -b 1K -e 64M --pattern random

``diag`` commands follow nccl-tests (same options, same columns), so their
output reads like the tables people already know. Everything moves host
(NumPy) arrays over the MPI backend; usage errors are found before MPI
starts, identically on every rank, so no rank is left waiting.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from typing import Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import click
import ml_dtypes
import numpy as np
from click.core import ParameterSource

import commlib
from commlib.namespace import FRAMEWORKS
from commlib.tools.world import mpiexec_path, world
from commlib.topology import RANKS_PER_NODE_ENV, Topology

PATTERNS = ("uniform", "random", "zipf", "hotspot", "router")
MPI_ENV_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")
LINK_BYTES = 1024 ** 2
LINK_ITERS = 5
# --slow-links: a link is slow when it takes over this many times the fastest
# link of its kind (the fastest is never slow, so it stands for a healthy one)
SLOW_FACTOR = 2.0
# the kinds of link: between ranks of one host, between ranks of two hosts (also
# the names of the parts of a Row sent apart)
INSIDE, BETWEEN = "inside", "between"
# --slow-links names at most this many single slow links (the matrix has them all)
_MAX_LINKS_NAMED = 5
# show the progress line only once a sweep has run this long
_PROGRESS_AFTER_S = 2.0
_SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
# check values stay below this, so that they convert to float64 exactly
_MAX_DISTINCT_VALUES = 2 ** 32


# -- option types ------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from nccl-tests notation: a positive whole number with an
    optional K, M or G suffix (powers of 1024), e.g. ``64K``."""
    raw = text.strip()
    suffix = raw[-1:].upper() if raw[-1:].isalpha() else ""
    digits = raw[:len(raw) - len(suffix)]
    if suffix not in _SIZE_SUFFIXES or not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"{text!r} is not a size: use a positive whole number of bytes, "
                         f"optionally followed by K, M or G (powers of 1024), e.g. 64K")
    return int(digits) * _SIZE_SUFFIXES[suffix]


def parse_dtype(name: str) -> np.dtype:
    """A numeric element type by name: NumPy's (float32, int8, bool, ...)
    or ml_dtypes' (bfloat16, float8_e4m3fn, ...), which NumPy cannot name."""
    extension = getattr(ml_dtypes, name, None)
    try:
        dtype = np.dtype(extension if extension is not None else name)
    except TypeError:
        dtype = None
    numeric = dtype is not None and (dtype.kind in "biufc"
                                     or (extension is not None and dtype.kind == "V"))
    if not numeric:
        raise ValueError(f"{name!r} is not a numeric element type: use a NumPy name "
                         f"(float32, float16, int32, ...) or an ml_dtypes one (bfloat16, "
                         f"float8_e4m3fn, ...)")
    return dtype


class ByteSize(click.ParamType):
    """Click type for ``parse_size``: a bad size is a usage error (exit 2)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class ElementType(click.ParamType):
    """Click type for ``parse_dtype``: an unknown type is a usage error."""

    name = "dtype"

    def convert(self, value, param, ctx) -> np.dtype:
        if isinstance(value, np.dtype):
            return value
        try:
            return parse_dtype(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


# -- the sweep every diag command runs -----------------------------------------
@dataclass(frozen=True)
class Sweep:
    """nccl-tests' common settings: sizes from -b to -e bytes per rank,
    stepping by -f, -w untimed and -n timed iterations each, -c check."""

    minbytes: int
    maxbytes: int
    stepfactor: int
    iters: int
    warmup_iters: int
    check: int
    dtype: np.dtype

    def sizes(self) -> List[int]:
        """minbytes, times stepfactor, and so on up to maxbytes."""
        sizes = []
        size = self.minbytes
        while size <= self.maxbytes:
            sizes.append(size)
            size *= self.stepfactor
        return sizes

    def describe(self) -> str:
        """The settings, as nccl-tests' header line states them."""
        return (f"# minBytes {self.minbytes} maxBytes {self.maxbytes} step: "
                f"{self.stepfactor}(factor) warmup iters: {self.warmup_iters} iters: "
                f"{self.iters} validation: {self.check} dtype: {self.dtype.name}")


_SWEEP_OPTIONS = (
    click.option("-b", "--minbytes", type=ByteSize(), default="1K", show_default=True,
                 help="Smallest size: bytes each rank sends in total (K, M, G suffixes)."),
    click.option("-e", "--maxbytes", type=ByteSize(), default="1M", show_default=True,
                 help="Largest size, in the same notation."),
    click.option("-f", "--stepfactor", type=click.IntRange(min=2), default=2,
                 show_default=True, help="Multiply the size by this between rows."),
    click.option("-n", "--iters", type=click.IntRange(min=1), default=20, show_default=True,
                 help="Timed iterations per size."),
    click.option("-w", "--warmup_iters", type=click.IntRange(min=0), default=5,
                 show_default=True, help="Untimed iterations before timing."),
    click.option("-c", "--check", type=click.IntRange(0, 1), default=1, show_default=True,
                 help="1: check every received element; 0: skip (#wrong is N/A)."),
    click.option("--dtype", type=ElementType(), default="float32", show_default=True,
                 help="Element type: a NumPy name, or bfloat16 / float8_* (ml_dtypes)."),
)


def sweep_options(command: Callable) -> Callable:
    """Give a diag command nccl-tests' options, handed to it as one
    ``sweep: Sweep`` once -b is known not to exceed -e."""
    @functools.wraps(command)
    def with_sweep(*args, minbytes: int, maxbytes: int, stepfactor: int, iters: int,
                   warmup_iters: int, check: int, dtype: np.dtype, **kwargs):
        if minbytes > maxbytes:
            raise click.BadParameter(f"{minbytes} bytes is larger than --maxbytes "
                                     f"({maxbytes} bytes); the sweep runs from -b up to -e",
                                     param_hint="'-b' / '--minbytes'")
        sweep = Sweep(minbytes, maxbytes, stepfactor, iters, warmup_iters, check, dtype)
        return command(*args, sweep=sweep, **kwargs)

    for option in reversed(_SWEEP_OPTIONS):
        with_sweep = option(with_sweep)
    return with_sweep


# -- shared helpers ----------------------------------------------------------
def describe_topology(topology: Topology) -> str:
    """Nodes, ranks per node, and where the node boundaries come from."""
    per_node = [len(topology.ranks_of(node)) for node in range(topology.num_nodes)]
    ranks = (plural(per_node[0], "rank") + " per node" if topology.is_uniform
             else "ranks per node " + ",".join(map(str, per_node)))
    source = f"emulated by {RANKS_PER_NODE_ENV}" if topology.emulated else "from shared memory"
    return f"{plural(topology.num_nodes, 'node')}, {ranks} ({source})"


def plural(count: int, noun: str) -> str:
    """``1 rank``, ``3 ranks``."""
    return f"{count} {noun}{'s' if count != 1 else ''}"


# -- --np ----------------------------------------------------------------------
def relaunchable(command: click.Command) -> click.Command:
    """Give ``command`` the ``--np NP`` option: started outside MPI, it runs
    itself again as ``mpiexec -n NP`` with the same options; under MPI the
    option is ignored. Every command that runs under MPI has it."""
    command.params.append(click.Option(
        ["--np", "nprocs"], type=click.IntRange(min=1),
        help="Not under MPI yet: re-launch as mpiexec -n NP with the same options."))
    run_here = command.callback

    @functools.wraps(run_here)
    def run_or_relaunch(*args, nprocs: Optional[int] = None, **kwargs):
        if nprocs is not None and not under_mpi():
            click.get_current_context().exit(relaunch(nprocs, sys.argv[1:]))
        return run_here(*args, **kwargs)

    command.callback = run_or_relaunch
    return command


# -- commands --------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(commlib.__version__, prog_name="commlib")
def main() -> None:
    """commlib: collectives for context and expert parallelism.

    Launch like any MPI program (mpiexec -n P commlib ...), or give info or
    a diag command --np P to have it launch itself; rank 0 prints. simulate
    needs no MPI.
    """


@relaunchable
@main.command()
def info() -> None:
    """What this launch sees: MPI library, world, topology, backends
    (whether CUDA arrays go to MPI directly or are staged, and why) and
    array frameworks."""
    with world() as comm:
        if comm.rank == 0:
            click.echo("\n".join(info_lines(comm)))


def info_lines(comm: commlib.Communicator) -> List[str]:
    """The report of ``commlib info``, one line per fact."""
    import mpi4py
    from mpi4py import MPI

    from commlib.backends import nccl

    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    nccl_reason = nccl.unavailable_reason()
    return [
        f"commlib     {commlib.__version__}",
        f"MPI library {library} (mpi4py {mpi4py.__version__})",
        f"world size  {comm.size}",
        f"topology    {describe_topology(comm.topology)}",
        "backends    mpi: available",
        "            nccl: " + ("available" if nccl_reason is None
                                else f"unavailable ({nccl_reason})"),
        f"nccl        {nccl_version()}",
        f"gpus        {_gpu_count()}",
        f"cuda-aware  {_cuda_aware_decision()}",
        "frameworks  " + ", ".join(_framework_status(name) for name in FRAMEWORKS),
    ]


def nccl_version() -> str:
    """NCCL's version as CuPy reports it (e.g. 22005 -> 2.20.5), or why not.
    Any failure (no CuPy, no NCCL, no driver) is a fact to print, not an error."""
    try:
        from cupy.cuda import nccl as cupy_nccl

        code = int(cupy_nccl.get_version())
    except Exception as error:  # noqa: BLE001 - every failure is reported
        return f"unknown ({type(error).__name__})"
    return nccl_version_text(code)


def nccl_version_text(code: int) -> str:
    """NCCL's version code as a version: 22005 -> 2.20.5 (2.9 and older: 2904)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _gpu_count() -> str:
    """CUDA devices this rank sees, or "unknown" without CuPy or a driver."""
    try:
        import cupy

        return str(cupy.cuda.runtime.getDeviceCount())
    except Exception as error:  # noqa: BLE001 - every failure is reported
        return f"unknown ({type(error).__name__})"


def _cuda_aware_decision() -> str:
    """What ``backends.cuda_aware.detect()`` decides for CUDA arrays over
    MPI, and why: the decision the staged backend acts on. A bad
    ``COMMLIB_MPI_CUDA_AWARE`` is reported, not raised."""
    from commlib.backends import cuda_aware

    try:
        support = cuda_aware.detect()
    except ValueError as error:
        return f"error: {error}"
    return cuda_aware.describe(support)


def _framework_status(module: str) -> str:
    """``torch 2.4.0`` or ``jax: not installed``, found without importing
    the module (importing torch or jax alone takes seconds)."""
    if importlib.util.find_spec(module) is None:
        return f"{module}: not installed"
    distribution = packages_distributions().get(module, [module])[0]
    try:
        return f"{module} {version(distribution)}"
    except PackageNotFoundError:
        return f"{module} (version unknown)"


@main.group()
def diag() -> None:
    """Collective benchmarks with a correctness check, nccl-tests style."""


@relaunchable
@diag.command("alltoall")
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


# -- alltoall: traffic and check -----------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """Who sends how much to whom: the --pattern and the settings it reads.
    ``skew`` is the zipf exponent (zipf) or the expert-popularity exponent
    (router); ``experts``/``topk`` shape the synthetic router; ``spread``
    tilts uniform toward distant ranks; ``matrix`` ([P, P] bytes from
    --matrix) replaces the pattern."""

    pattern: str = "uniform"
    seed: int = 0
    experts: int = 64
    topk: int = 8
    skew: float = 0.0
    tokens: int = 128
    spread: float = 0.0
    matrix: Optional[np.ndarray] = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        """The traffic as the header line names it."""
        if self.matrix is not None:
            return "matrix"
        return f"{self.pattern} spread: {self.spread:g}" if self.spread else self.pattern

    def counts(self, nbytes: int, nranks: int, dtype: np.dtype) -> np.ndarray:
        """[nranks, nranks] elements rank i sends to rank j when each rank
        sends ``nbytes``: the matrix's, whatever the size, else the pattern's."""
        if self.matrix is not None:
            return self.matrix // dtype.itemsize
        return count_matrix(self.pattern, nbytes // dtype.itemsize, nranks, self.seed, self)


def count_matrix(pattern: str, count: int, size: int, seed: int,
                 traffic: Optional[Traffic] = None) -> np.ndarray:
    """[size, size] int64: elements rank i sends to rank j. Every rank
    computes the same matrix (all randomness is seeded by ``seed`` and
    ``count``), so receive counts are known and the timed call is the data
    exchange alone.

    uniform rounds ``count`` down to a multiple of ``size`` (as nccl-tests
    does), or with a spread each share (see ``spread_matrix``); random, zipf
    and hotspot split all of it, so each row sums to ``count``; router rows
    sum to at most ``count`` (see ``router_matrix``). ``traffic`` carries the
    spread, zipf and router settings; without it, defaults.
    """
    traffic = traffic or Traffic(pattern, seed)
    if pattern == "uniform":
        return spread_matrix(count, size, traffic.spread)
    if pattern == "hotspot":
        return hotspot_matrix(count, size)
    if pattern == "router":
        return router_matrix(count, size, traffic)
    rng = np.random.default_rng([seed, count])
    if pattern == "zipf":
        offsets = (np.arange(size)[None, :] - np.arange(size)[:, None]) % size
        weights = 1.0 / (offsets + 1.0) ** traffic.skew
        weights /= weights.sum(axis=1, keepdims=True)
    else:
        weights = rng.dirichlet(np.ones(size), size=size)
    return np.stack([rng.multinomial(count, row) for row in weights]).astype(np.int64)


def spread_matrix(count: int, size: int, spread: float) -> np.ndarray:
    """nccl-tests' alltoallv_perf pattern: rank i gives rank j
    (1 - spread) count/size + spread count d/(size(size-1)/2) elements,
    rounded down, where d = (j - i) mod size is j's distance ahead of i on
    the ring. Spread 0 is uniform (count // size each); 1 sends nothing to
    itself and most to the rank just behind it. Every row and every column
    holds the same shares, so all ranks send and receive the same total."""
    if size == 1:
        return np.full((1, 1), count, dtype=np.int64)
    distance = (np.arange(size)[None, :] - np.arange(size)[:, None]) % size
    shares = ((1 - spread) * (count / size)
              + spread * (count * distance / (size * (size - 1) / 2)))
    return np.floor(shares).astype(np.int64)


def hotspot_matrix(count: int, size: int, hot_rank: int = 0) -> np.ndarray:
    """Every rank sends half of ``count`` to ``hot_rank`` and splits the rest
    evenly over the others (the remainder also to ``hot_rank``): the incast
    that one overloaded expert's rank sees."""
    if size == 1:
        return np.full((1, 1), count, dtype=np.int64)
    matrix = np.full((size, size), (count - count // 2) // (size - 1), dtype=np.int64)
    matrix[:, hot_rank] = 0
    matrix[:, hot_rank] = count - matrix.sum(axis=1)
    return matrix


def router_rows(count: int, size: int, traffic: Traffic) -> int:
    """Elements per token row: a token reaches at most min(topk, size) ranks,
    so ``tokens`` of them never send more than ``count`` per rank. Sizes grow
    the row (the hidden width), not the token count; at least one element."""
    return max(1, count // (traffic.tokens * min(traffic.topk, size)))


def router_destinations(sender: int, count: int, size: int, traffic: Traffic) -> np.ndarray:
    """[tokens, topk] ranks that ``sender``'s tokens are routed to, by
    ``commlib.moe.route`` on seeded random logits plus a log-popularity bias
    (expert popularity ~ 1/(r+1)^skew over a seeded ranking r; skew 0 is
    uniform). Expert e lives on rank e // (experts // size)."""
    from commlib.moe import route

    popularity_rng = np.random.default_rng([traffic.seed, count])
    ranking = popularity_rng.permutation(traffic.experts)
    bias = -traffic.skew * np.log1p(ranking)
    rng = np.random.default_rng([traffic.seed, count, sender])
    logits = rng.standard_normal((traffic.tokens, traffic.experts)) + bias
    experts, _ = route(logits.astype(np.float32), traffic.topk)
    return np.asarray(experts) // (traffic.experts // size)


def router_matrix(count: int, size: int, traffic: Traffic) -> np.ndarray:
    """Elements each rank dispatches to each rank: the number of distinct
    tokens routed there (a token goes once to a rank, however many of its
    experts live there, as the Dispatcher sends it) times the row size."""
    row = router_rows(count, size, traffic)
    matrix = np.zeros((size, size), dtype=np.int64)
    for sender in range(size):
        ranks = router_destinations(sender, count, size, traffic)
        reached = np.zeros((len(ranks), size), dtype=bool)
        np.put_along_axis(reached, ranks, True, axis=1)
        matrix[sender] = reached.sum(axis=0) * row
    return matrix


def check_traffic(traffic: Traffic, world_size: int) -> None:
    """Usage errors of the traffic settings. Called before any MPI
    communication, from argv, the world size and the --matrix file alone,
    so every rank fails the same way and none is left waiting."""
    if traffic.matrix is not None and (traffic.pattern != "uniform" or traffic.spread):
        raise click.BadParameter("the matrix says who sends what: drop --pattern and "
                                 "--spread", param_hint="'--matrix'")
    if traffic.spread and traffic.pattern != "uniform":
        raise click.BadParameter(f"--spread tilts the uniform pattern; {traffic.pattern} "
                                 f"splits the bytes its own way", param_hint="'--spread'")
    if traffic.pattern != "router":
        return
    if traffic.experts % world_size:
        raise click.BadParameter(f"{traffic.experts} experts do not divide over "
                                 f"{plural(world_size, 'rank')}; use a multiple of the "
                                 f"world size", param_hint="'--experts'")
    if traffic.topk > traffic.experts:
        raise click.BadParameter(f"top-{traffic.topk} of {traffic.experts} experts is "
                                 f"impossible; use at most --experts",
                                 param_hint="'--topk'")


def read_matrix(path: str, world_size: int, dtype: np.dtype) -> np.ndarray:
    """[P, P] int64 bytes from a --matrix file: a row per line, entries
    split by whitespace or commas, '#' to the end of a line a comment.
    Every rank reads and checks the same file before any communication, so
    a bad one is the same usage error everywhere and no rank is left waiting."""
    def fail(reason: str) -> NoReturn:
        raise click.BadParameter(f"{path}: {reason}", param_hint="'--matrix'")

    with open(path, encoding="utf-8", errors="replace") as file:
        lines = [(number, [cell for cell in re.split(r"[\s,]+", line.split("#", 1)[0]) if cell])
                 for number, line in enumerate(file, start=1)]
    rows = [(number, cells) for number, cells in lines if cells]
    if not rows:
        fail("empty: no rows besides blank lines and '#' comments")
    for number, cells in rows:
        if len(cells) != len(rows):
            fail(f"not square: line {number} has {plural(len(cells), 'value')} and there "
                 f"are {plural(len(rows), 'row')}")
    if len(rows) != world_size:
        fail(f"{plural(len(rows), 'row')} for {plural(world_size, 'rank')}: the matrix "
             f"needs a row and a column per rank")
    for number, cells in rows:
        for cell in cells:
            if re.fullmatch(r"-?[0-9]+", cell) is None:
                fail(f"line {number}: {cell!r} is not a number; values are whole bytes")
            if int(cell) < 0:
                fail(f"line {number}: {cell} bytes is negative")
            if int(cell) % dtype.itemsize:
                fail(f"line {number}: {cell} bytes is not a whole number of {dtype.name} "
                     f"elements ({dtype.itemsize} bytes each)")
    return np.array([[int(cell) for cell in cells] for _, cells in rows], dtype=np.int64)


def rank_bytes(matrix: np.ndarray) -> np.ndarray:
    """[P] what each rank sends or receives, whichever is more: the load
    nccl-tests' alltoallv_perf rates a rank by."""
    return np.maximum(matrix.sum(axis=1), matrix.sum(axis=0))


def matrix_sweep(sweep: Sweep, matrix: np.ndarray, sized: bool) -> Sweep:
    """The one size of a --matrix run, its busiest rank's bytes, when -b and
    -e were omitted (``sized`` false). Given, they must be equal and hold
    those bytes, as nccl-tests' alltoallv_perf demands (it sizes its buffers
    by -e; here it is only checked, so a command line means the same in both)."""
    busiest = int(rank_bytes(matrix).max())
    if busiest == 0:
        raise click.BadParameter("the matrix sends no bytes at all", param_hint="'--matrix'")
    if not sized:
        return replace(sweep, minbytes=busiest, maxbytes=busiest)
    if sweep.minbytes != sweep.maxbytes:
        raise click.BadParameter(f"-b ({sweep.minbytes} bytes) differs from -e "
                                 f"({sweep.maxbytes} bytes); with --matrix there is one size: "
                                 f"give -b and -e the same value, or neither",
                                 param_hint="'-b' / '-e'")
    if sweep.maxbytes < busiest:
        raise click.BadParameter(f"{sweep.maxbytes} bytes is less than the {busiest} the "
                                 f"matrix's busiest rank sends or receives",
                                 param_hint="'-b' / '-e'")
    return sweep


def block_values(sender: int, dest: int, count: int, dtype: np.dtype) -> np.ndarray:
    """The ``count`` elements ``sender`` sends to ``dest``: a hash of
    (sender, dest, index) that ``dest`` can recompute, so an element from the
    wrong rank or at the wrong place is, almost always, a wrong value."""
    salt = ((sender * 65537 + dest) << 32) % 2 ** 64
    x = np.arange(count, dtype=np.uint64) ^ np.uint64(salt)
    for shift, multiplier in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x ^= x >> np.uint64(shift)
        x *= np.uint64(multiplier)  # wraps modulo 2**64, as a hash should
    x ^= x >> np.uint64(31)
    values = x % np.uint64(_distinct_values(dtype))
    return values.astype(np.int64 if dtype.kind in "biu" else np.float64).astype(dtype)


def _distinct_values(dtype: np.dtype) -> int:
    """How many consecutive integers from 0 ``dtype`` holds exactly: check
    values stay below it, so distinct hashes stay distinct elements."""
    if dtype.kind == "b":
        return 2
    if dtype.kind in "iu":
        return min(int(np.iinfo(dtype).max) + 1, _MAX_DISTINCT_VALUES)
    return min(2 ** (ml_dtypes.finfo(dtype).nmant + 1), _MAX_DISTINCT_VALUES)


def send_buffer(rank: int, send_counts: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """What ``rank`` sends: its block for rank 0, then for rank 1, ..."""
    return np.concatenate([block_values(rank, dest, int(n), dtype)
                           for dest, n in enumerate(send_counts)])


def expected_receive(rank: int, recv_counts: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """What ``rank`` must receive: rank 0's block for it, then rank 1's, ..."""
    return np.concatenate([block_values(sender, rank, int(n), dtype)
                           for sender, n in enumerate(recv_counts)])


def count_wrong(received: np.ndarray, rank: int, recv_counts: Sequence[int]) -> int:
    """Elements of ``received`` that differ from what ``rank`` must receive,
    plus any missing or extra ones. Compared bit for bit, so NaN or -0.0
    produced by a corrupted transfer count as wrong."""
    expected = expected_receive(rank, recv_counts, received.dtype)
    common = min(received.size, expected.size)
    got = np.ascontiguousarray(received[:common]).view(np.uint8)
    want = np.ascontiguousarray(expected[:common]).view(np.uint8)
    itemsize = received.dtype.itemsize
    differs = (got.reshape(common, itemsize) != want.reshape(common, itemsize)).any(axis=1)
    return int(differs.sum()) + abs(received.size - expected.size)


# -- tables and alltoall timing ---------------------------------------------
@dataclass(frozen=True)
class RankTime:
    """One rank at one size, for --per-rank: bytes it sends and receives and
    the median of its own iteration times (seconds)."""

    rank: int
    send: int
    recv: int
    time: float

    @property
    def algbw(self) -> float:
        """GB/s: the larger of its send and receive bytes over its own time."""
        return max(self.send, self.recv) / self.time / 1e9

    def as_json(self) -> dict:
        """The rank for --json, in the units of ``Row.as_json``."""
        return {"rank": self.rank, "send_bytes": self.send, "recv_bytes": self.recv,
                "time_us_p50": self.time * 1e6, "algbw_gbps": self.algbw}


@dataclass(frozen=True)
class Row:
    """One line of the table. ``size`` is what the busiest rank sends or
    receives, whichever is more (as nccl-tests' alltoallv_perf reports);
    times in seconds are each iteration's slowest rank, summarized; bandwidths
    in GB/s are ``size`` over the average; wrong elements are summed over ranks
    (None when the check is off); ``ranks`` are the per-rank figures."""

    size: int
    count: int
    dtype: str
    avg: float
    min: float
    max: float
    p50: float
    p99: float
    algbw: float
    busbw: float
    wrong: Optional[int]
    busiest: int
    ranks: Tuple[RankTime, ...]
    inside: Optional["Row"] = None
    between: Optional["Row"] = None

    def as_json(self) -> dict:
        """The row for --json: times in microseconds, bandwidths in GB/s,
        ``wrong`` null when the check is off; the parts inside and between
        hosts as rows of their own, null where they were not sent apart."""
        return {"size_bytes": self.size, "count": self.count, "dtype": self.dtype,
                "time_us_avg": self.avg * 1e6, "time_us_min": self.min * 1e6,
                "time_us_max": self.max * 1e6, "time_us_p50": self.p50 * 1e6,
                "time_us_p99": self.p99 * 1e6, "algbw_gbps": self.algbw,
                "busbw_gbps": self.busbw, "wrong": self.wrong, "busiest_rank": self.busiest,
                "ranks": [rank.as_json() for rank in self.ranks],
                "inside_hosts": None if self.inside is None else self.inside.as_json(),
                "between_hosts": None if self.between is None else self.between.as_json()}


_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 15),
            ("time avg", "(us)", 10), ("min", "(us)", 10), ("max", "(us)", 10),
            ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 7))
_RANK_COLUMNS = (("rank", "", 8), ("send", "(B)", 12), ("recv", "(B)", 12),
                 ("time p50", "(us)", 10), ("algbw", "(GB/s)", 8))
_HOST_COLUMNS = (("size", "(B)", 12), ("inside", "(B)", 12), ("time avg", "(us)", 10),
                 ("algbw", "(GB/s)", 8), ("between", "(B)", 12), ("time avg", "(us)", 10),
                 ("algbw", "(GB/s)", 8))


def bus_bandwidth(algbw: float, nranks: int) -> float:
    """nccl-tests' all-to-all bus bandwidth: of what a rank sends, the
    (n-1)/n that leaves it crosses the links; a world of one moves nothing."""
    return algbw * (nranks - 1) / nranks


def format_row(row: Row) -> str:
    """A table line, aligned under ``_COLUMNS``."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    return _aligned((row.size, row.count, row.dtype, f"{row.avg * 1e6:.2f}",
                     f"{row.min * 1e6:.2f}", f"{row.max * 1e6:.2f}", f"{row.algbw:.3f}",
                     f"{row.busbw:.3f}", wrong), _COLUMNS)


def _aligned(cells: Sequence, columns: Sequence[Tuple[str, str, int]]) -> str:
    """Cells right-aligned to the widths of ``columns``, under their titles."""
    return "  " + " ".join(f"{cell:>{width}}" for cell, (_, _, width) in zip(cells, columns))


def table_header(columns: Sequence[Tuple[str, str, int]] = _COLUMNS) -> str:
    """The '#'-prefixed column titles, aligned over ``_aligned``'s cells."""
    titles = [" ".join(f"{column[line]:>{width}}" for *column, width in columns)
              for line in (0, 1)]
    return "\n".join(["#", "# " + titles[0], ("# " + titles[1]).rstrip()])


def per_rank_lines(row: Row) -> List[str]:
    """--per-rank at one size: each rank's bytes, own median time and algbw,
    then the busiest rank, whose bytes the row's bandwidths use."""
    lines = [f"# per rank at {row.size} B: own median time, algbw = max(send, recv) / time",
             *table_header(_RANK_COLUMNS).splitlines()[1:]]
    lines += [_aligned((rank.rank, rank.send, rank.recv, f"{rank.time * 1e6:.2f}",
                        f"{rank.algbw:.3f}"), _RANK_COLUMNS) for rank in row.ranks]
    return lines + [f"# busiest rank: {row.busiest} ({row.size} B)"]


def host_part_lines(rows: Sequence[Row]) -> List[str]:
    """Each size's parts inside and between hosts: the busiest rank's bytes of
    the part, its time avg and algbw. Every line is a '#' comment, so the
    table's data lines stay the sizes'."""
    lines = ["# inside hosts (each host's ranks among themselves) and between hosts (pairs "
             "on different hosts), each sent alone",
             *table_header(_HOST_COLUMNS).splitlines()[1:]]
    for row in rows:
        cells = [row.size]
        for part in (row.inside, row.between):
            cells += [part.size, f"{part.avg * 1e6:.2f}", f"{part.algbw:.3f}"]
        lines.append("#" + _aligned(cells, _HOST_COLUMNS)[1:])
    return lines


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


# -- slow links -----------------------------------------------------------------
def time_links(comm: commlib.Communicator, nbytes: int = LINK_BYTES,
               iters: int = LINK_ITERS) -> np.ndarray:
    """[size, size] seconds for ``nbytes`` each way between ranks i and j,
    the best of ``iters``, while the other ranks send nothing. Each pair is
    one alltoallv with counts for that pair only, so a slow link stands out
    instead of being averaged into the full exchange; O(size^2) small calls."""
    times = np.zeros((comm.size, comm.size), dtype=np.float64)
    payload = np.zeros(nbytes, dtype=np.uint8)
    for i in range(comm.size):
        for j in range(i + 1, comm.size):
            counts = np.zeros(comm.size, dtype=np.int64)
            if comm.rank in (i, j):
                counts[j if comm.rank == i else i] = nbytes
            send = payload if comm.rank in (i, j) else payload[:0]
            times[i, j] = times[j, i] = _best_exchange(comm, send, counts, iters)
    return comm.allreduce(times, op="max")


def _best_exchange(comm: commlib.Communicator, send: np.ndarray, counts: np.ndarray,
                   iters: int) -> float:
    """The fastest of ``iters`` barrier-started exchanges, as this rank saw it
    (idle ranks see ~0 and lose the "max" reduction to the pair)."""
    best = float("inf")
    for _ in range(iters):
        comm.barrier()
        start = time.perf_counter()
        comm.alltoallv(send, counts, counts)
        best = min(best, time.perf_counter() - start)
    return best


def link_kinds(topology: Topology) -> Dict[str, np.ndarray]:
    """[P, P] masks of the links of each kind: between two ranks of one host
    (INSIDE), between ranks of two hosts (BETWEEN); a rank's copy to itself
    is neither."""
    nodes = np.asarray(topology.node_of_rank)
    same = nodes[:, None] == nodes[None, :]
    return {INSIDE: same & ~np.eye(len(nodes), dtype=bool), BETWEEN: ~same}


@dataclass(frozen=True)
class Culprit:
    """What --slow-links names: a host (``kind`` "host": a node and its
    ranks), a rank (its node too) or a link (two ranks, ``node`` None), and
    ``ratio``, the median over its slow links of their time over the median
    healthy link of the same kind."""

    kind: str
    ranks: Tuple[int, ...]
    node: Optional[int]
    ratio: float

    def as_json(self) -> dict:
        """The culprit for --json."""
        return {"kind": self.kind, "ranks": list(self.ranks), "node": self.node,
                "ratio": self.ratio}


@dataclass(frozen=True, eq=False)  # arrays: no meaningful ==
class SlowLinks:
    """--slow-links' verdict on [P, P] link times (seconds): ``slow`` marks
    the links over ``factor`` x the fastest of their kind, ``typical`` is the
    median of each kind's healthy links (None: no link of that kind), and
    ``culprits`` explain the slow links, widest cause first."""

    times: np.ndarray
    node_of_rank: Tuple[int, ...]
    factor: float
    slow: np.ndarray
    typical: Dict[str, Optional[float]]
    culprits: Tuple[Culprit, ...]

    def as_json(self) -> dict:
        """The links for --json: the matrix (0 on the diagonal) and the
        verdict, so that both can be drawn."""
        return {"bytes": LINK_BYTES, "iters": LINK_ITERS, "factor": self.factor,
                "node_of_rank": list(self.node_of_rank),
                "time_us": (self.times * 1e6).tolist(), "slow": self.slow.tolist(),
                "typical_us": {kind: None if time is None else time * 1e6
                               for kind, time in self.typical.items()},
                "culprits": [culprit.as_json() for culprit in self.culprits]}


def attribute_slow_links(times: np.ndarray, topology: Topology,
                         factor: float = SLOW_FACTOR) -> SlowLinks:
    """Which host, rank or link makes the slow links slow, from the times
    alone. A link is slow over ``factor`` x the fastest link of its kind
    (inside a host, between hosts: shared memory and the network differ),
    not over the median: a slow host owns 2 of the 3 links of 3 hosts.
    Then, widest first: a host whose every link to other hosts is slow (of
    two hosts, never: the fastest link between them is not); a rank, not
    alone on its host, whose every link is slow; the slow links neither
    explains, one by one, slowest first."""
    kinds = link_kinds(topology)
    slow = np.zeros(times.shape, dtype=bool)
    ratio = np.zeros(times.shape)
    typical: Dict[str, Optional[float]] = {}
    for kind, mask in kinds.items():
        typical[kind] = None
        if mask.any():
            slow |= mask & (times > factor * times[mask].min())
            typical[kind] = float(np.median(times[mask & ~slow]))
            ratio[mask] = times[mask] / typical[kind]
    culprits = []
    explained = np.zeros(times.shape, dtype=bool)

    def name(kind: str, links: np.ndarray, ranks: Tuple[int, ...], node: int) -> None:
        if links.any() and slow[links].all():
            culprits.append(Culprit(kind, ranks, node, float(np.median(ratio[links]))))
            explained[links] = True

    nodes = np.asarray(topology.node_of_rank)
    for node in range(topology.num_nodes):
        on_node = nodes == node
        name("host", kinds[BETWEEN] & (on_node[:, None] | on_node[None, :]),
             topology.ranks_of(node), node)
    for rank in range(topology.size):
        if len(topology.ranks_of(topology.node_of(rank))) > 1:
            touching = np.zeros(times.shape, dtype=bool)
            touching[rank, :] = touching[:, rank] = True
            name("rank", touching & ~np.eye(topology.size, dtype=bool), (rank,),
                 topology.node_of(rank))
    single = sorted(zip(*np.nonzero(np.triu(slow & ~explained))),
                    key=lambda link: -ratio[link])
    culprits += [Culprit("link", (int(i), int(j)), None, float(ratio[i, j]))
                 for i, j in single]
    return SlowLinks(times, tuple(topology.node_of_rank), factor, slow, typical,
                     tuple(culprits))


def slow_link_lines(links: SlowLinks) -> List[str]:
    """The link matrix in microseconds, '-' on the diagonal, slow links
    starred, and below it what is slow, or that nothing is."""
    times = links.times
    size = len(times)
    lines = [f"# slow links: {LINK_BYTES} B each way between each pair, best of "
             f"{LINK_ITERS}, time (us)",
             f"# * slow: over {links.factor:g}x the fastest link of its kind (inside a "
             f"host, between hosts)",
             "#  src\\dst" + "".join(f"{j:>11}" for j in range(size))]
    if size < 2:
        return lines + ["# no links in a world of one"]
    for i in range(size):
        cells = ["-" if i == j else f"{times[i, j] * 1e6:.1f}" + ("*" if links.slow[i, j]
                 else " ") for j in range(size)]
        lines.append(f"  {i:>8}" + "".join(f"{cell:>11}" for cell in cells))
    if not links.culprits:
        return lines + [f"# no slow links: none takes over {links.factor:g}x the fastest "
                        f"link of its kind"]
    single = [culprit for culprit in links.culprits if culprit.kind == "link"]
    lines += [_culprit_line(culprit, links) for culprit in links.culprits
              if culprit.kind != "link"]
    lines += [_culprit_line(culprit, links) for culprit in single[:_MAX_LINKS_NAMED]]
    if len(single) > _MAX_LINKS_NAMED:
        lines.append(f"# ... and {len(single) - _MAX_LINKS_NAMED} more slow links "
                     f"(starred above)")
    return lines


def _culprit_line(culprit: Culprit, links: SlowLinks) -> str:
    """One culprit named, with how much slower than healthy its links are."""
    ranks = ", ".join(map(str, culprit.ranks))
    slower = f"{culprit.ratio:.1f}x slower than the median healthy link"
    if culprit.kind == "host":
        return (f"# slow host node{culprit.node} (rank{'s' if len(culprit.ranks) > 1 else ''} "
                f"{ranks}): its links to other hosts {slower} between hosts")
    if culprit.kind == "rank":
        return f"# slow rank {ranks} (on node{culprit.node}): its links {slower}"
    i, j = culprit.ranks
    kind = "inside a host" if links.node_of_rank[i] == links.node_of_rank[j] \
        else "between hosts"
    return f"# slow link: {i} <-> {j}, {links.times[i, j] * 1e6:.1f} us, {slower} {kind}"


# -- relaunch and plot ------------------------------------------------------------
def under_mpi() -> bool:
    """Whether a launcher (MPICH/Hydra, Open MPI, PMIx) started this process."""
    return any(name in os.environ for name in MPI_ENV_VARS)


def without_np(argv: Sequence[str]) -> List[str]:
    """``argv`` less ``--np N`` / ``--np=N``, for the relaunched command."""
    kept: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--np":
            skip = True
        elif not arg.startswith("--np="):
            kept.append(arg)
    return kept


def relaunch(nprocs: int, argv: Sequence[str]) -> int:
    """Run this command again as ``mpiexec -n nprocs`` (the mpiexec beside
    this Python, else on PATH) and return its exit status."""
    launcher = mpiexec_path()
    if launcher is None:
        raise click.UsageError("--np needs mpiexec: pip install mpich, or launch with "
                               "mpiexec yourself")
    command = [launcher, "-n", str(nprocs), sys.executable, "-m", "commlib.tools.cli",
               *without_np(argv)]
    return subprocess.run(command).returncode


def plot_busbw(rows: Sequence[Row], path: str, nranks: int) -> None:
    """busbw against size, log2 x axis, to a PNG (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4))
    axes.plot([row.size for row in rows], [row.busbw for row in rows], marker="o")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size per rank (B)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"commlib diag alltoall, {plural(nranks, 'rank')}")
    axes.grid(True, which="both", alpha=0.3)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)


# commands that live in their own modules (they do not import this one)
from commlib.tools.cluster import cluster  # noqa: E402
from commlib.tools.diag_attention import ring as diag_ring  # noqa: E402
from commlib.tools.diag_attention import ulysses as diag_ulysses  # noqa: E402
from commlib.tools.diag_moe import moe  # noqa: E402
from commlib.tools.simulate import simulate  # noqa: E402

for command in (moe, diag_ring, diag_ulysses):
    diag.add_command(relaunchable(command))
main.add_command(simulate)
main.add_command(cluster)


if __name__ == "__main__":
    main()
