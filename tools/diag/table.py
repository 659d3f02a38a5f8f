"""``commlib diag alltoall``'s rows and how they print: nccl-tests' columns,
the per-rank lines of ``--per-rank``, the parts inside and between hosts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple


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
