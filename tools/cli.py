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
import time
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import click
import ml_dtypes
import numpy as np

import commlib
from commlib.topology import RANKS_PER_NODE_ENV, Topology

FRAMEWORKS = ("numpy", "cupy", "torch", "jax")
PATTERNS = ("uniform", "random")
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
@contextmanager
def _world() -> Iterator[commlib.Communicator]:
    """A communicator over every rank of the launch, freed on the way out.
    The CLI moves host arrays only, so NCCL is never set up. With peers, an
    uncaught error on any rank aborts the whole job instead of hanging it."""
    comm = commlib.init(backend="mpi")
    if comm.size > 1:
        commlib.abort_on_exception()
    try:
        yield comm
    finally:
        comm.free()


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


# -- commands --------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(commlib.__version__, prog_name="commlib")
def main() -> None:
    """commlib: collectives for context and expert parallelism.

    Launch like any MPI program (mpiexec -n P commlib ...); rank 0 prints.
    """


@main.command()
def info() -> None:
    """What this launch sees: MPI library, world, topology, backends and
    array frameworks."""
    with _world() as comm:
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
        "frameworks  " + ", ".join(_framework_status(name) for name in FRAMEWORKS),
    ]


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


@diag.command("alltoall")
@sweep_options
@click.option("--pattern", type=click.Choice(PATTERNS), default="uniform", show_default=True,
              help="uniform: equal bytes to every peer; random: seeded random split.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random pattern (the same on every rank).")
@click.pass_context
def alltoall(ctx: click.Context, sweep: Sweep, pattern: str, seed: int) -> None:
    """Time comm.alltoallv from -b to -e bytes per rank and check the data,
    like nccl-tests' alltoall_perf. Exits 1 if any element arrived wrong."""
    with _world() as comm:
        echo = click.echo if comm.rank == 0 else _silent
        echo(f"# commlib diag alltoall: {plural(comm.size, 'rank')}, "
             f"{describe_topology(comm.topology)}")
        echo(f"{sweep.describe()} pattern: {pattern}")
        echo(table_header())
        rows = [_alltoall_row(comm, size, sweep, pattern, seed, echo) for size in sweep.sizes()]
        echo(f"# Avg bus bandwidth : {np.mean([row.busbw for row in rows]):.3f}")
        wrong = sum(row.wrong or 0 for row in rows)
        if wrong:
            echo(f"# FAILED: {wrong} element(s) arrived wrong", err=True)
            ctx.exit(1)


def _silent(*_args, **_kwargs) -> None:
    """Stands in for ``click.echo`` on ranks other than 0."""


# -- alltoall: traffic and check -----------------------------------------------
def count_matrix(pattern: str, count: int, size: int, seed: int) -> np.ndarray:
    """[size, size] int64: elements rank i sends to rank j, each row summing to
    what one rank sends. Every rank computes the same matrix, so receive
    counts are known and the timed call is the data exchange alone.

    uniform rounds ``count`` down to a multiple of ``size`` (as nccl-tests
    does); random splits all of it by Dirichlet weights, skewed like MoE
    traffic, seeded by ``seed`` and ``count`` so each size differs.
    """
    if pattern == "uniform":
        return np.full((size, size), count // size, dtype=np.int64)
    rng = np.random.default_rng([seed, count])
    weights = rng.dirichlet(np.ones(size), size=size)
    return np.stack([rng.multinomial(count, row) for row in weights]).astype(np.int64)


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
class Row:
    """One line of the table: sizes per rank, times in seconds (the slowest
    rank of each iteration), bandwidths in GB/s, wrong elements over ranks
    (None when the check is off)."""

    size: int
    count: int
    dtype: str
    avg: float
    min: float
    max: float
    algbw: float
    busbw: float
    wrong: Optional[int]


_COLUMNS = (("size", "(B)", 12), ("count", "(elements)", 12), ("type", "", 15),
            ("time avg", "(us)", 10), ("min", "(us)", 10), ("max", "(us)", 10),
            ("algbw", "(GB/s)", 8), ("busbw", "(GB/s)", 8), ("#wrong", "", 7))


def bus_bandwidth(algbw: float, nranks: int) -> float:
    """nccl-tests' all-to-all bus bandwidth: of what a rank sends, the
    (n-1)/n that leaves it crosses the links; a world of one moves nothing."""
    return algbw * (nranks - 1) / nranks


def format_row(row: Row) -> str:
    """A table line, aligned under ``_COLUMNS``."""
    wrong = "N/A" if row.wrong is None else str(row.wrong)
    cells = (row.size, row.count, row.dtype, f"{row.avg * 1e6:.2f}", f"{row.min * 1e6:.2f}",
             f"{row.max * 1e6:.2f}", f"{row.algbw:.3f}", f"{row.busbw:.3f}", wrong)
    return "  " + " ".join(f"{cell:>{width}}" for cell, (_, _, width) in zip(cells, _COLUMNS))


def table_header() -> str:
    """The '#'-prefixed column titles, aligned over ``format_row``'s cells."""
    titles = [" ".join(f"{column[line]:>{width}}" for *column, width in _COLUMNS)
              for line in (0, 1)]
    return "\n".join(["#", "# " + titles[0], ("# " + titles[1]).rstrip()])


def _alltoall_row(comm: commlib.Communicator, size: int, sweep: Sweep, pattern: str,
                  seed: int, echo: Callable[..., None]) -> Row:
    """Run, time and check one size; print its line as soon as it is known."""
    dtype = sweep.dtype
    matrix = count_matrix(pattern, size // dtype.itemsize, comm.size, seed)
    send_counts, recv_counts = matrix[comm.rank], matrix[:, comm.rank]
    send = send_buffer(comm.rank, send_counts, dtype)
    times, received = time_alltoallv(comm, send, send_counts, recv_counts, sweep.iters,
                                     sweep.warmup_iters)
    wrong = None
    if sweep.check:
        local = np.array([count_wrong(received, comm.rank, recv_counts)], dtype=np.int64)
        wrong = int(comm.allreduce(local, op="sum")[0])
    count = int(matrix[0].sum())
    nbytes = count * dtype.itemsize
    algbw = nbytes / times.mean() / 1e9
    row = Row(nbytes, count, dtype.name, float(times.mean()), float(times.min()),
              float(times.max()), algbw, bus_bandwidth(algbw, comm.size), wrong)
    echo(format_row(row))
    return row


def time_alltoallv(comm: commlib.Communicator, send: np.ndarray, send_counts: np.ndarray,
                   recv_counts: np.ndarray, iters: int,
                   warmup_iters: int) -> Tuple[np.ndarray, np.ndarray]:
    """(seconds of each timed iteration on the slowest rank, the last result).

    Every iteration starts at a barrier, so it times one exchange and not
    the skew between ranks. The per-rank times are reduced with "max" once,
    after the loop, which gives each iteration's slowest rank without a
    collective between iterations.
    """
    for _ in range(warmup_iters):
        comm.alltoallv(send, send_counts, recv_counts)
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        comm.barrier()
        start = time.perf_counter()
        received, _ = comm.alltoallv(send, send_counts, recv_counts)
        times[i] = time.perf_counter() - start
    return comm.allreduce(times, op="max"), received


if __name__ == "__main__":
    main()
