"""``commlib diag alltoall``'s traffic: who sends how much to whom (the
patterns, ``--spread``, ``--matrix``), and the values it sends, so that every
received element is checked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import NoReturn, Optional, Sequence

import click
import ml_dtypes
import numpy as np

from commlib.tools.diag.sweep import Sweep
from commlib.tools.world import plural

PATTERNS = ("uniform", "random", "zipf", "hotspot", "router")
# check values stay below this, so that they convert to float64 exactly
_MAX_DISTINCT_VALUES = 2 ** 32


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
