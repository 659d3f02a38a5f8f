"""What the reliability layer costs: alltoallv (and allreduce) with and
without checks, against raw mpi4py, interleaved in one process.

    mpiexec -n 4 python -m commlib.tools.bench.reliability

alltoallv contenders: raw mpi4py (count exchange + Alltoallv, by hand);
commlib with recv_counts given (no exchange, no check); commlib as users
call it (counts exchanged, dtype/row-shape fingerprint checked, always on);
the same under COMMLIB_CHECK=1 (no extra work: the check rides on the
exchange); COMMLIB_CHECK=1 with recv_counts given (the exchange happens
anyway, and every rank verifies its recv_counts against the peers'). allreduce contenders:
raw ``Allreduce``, commlib, and commlib under COMMLIB_CHECK=1 (one extra
fingerprint all-to-all). Timing as in bench.alltoallv (bench.timing): primers, a Barrier,
the slowest rank's time, the median over iterations.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib.tools.bench.timing import auto_iters, time_interleaved, write_json
from commlib.tools.bench.workload import make_rows, mpi4py_exchange, parse_size, send_counts

SIZES = ("4K", "16M")


def alltoallv_contenders(plain: commlib.Communicator, checked: commlib.Communicator,
                         raw: MPI.Comm, recv: np.ndarray) -> Dict[str, Callable]:
    return {
        "mpi4py": mpi4py_exchange(raw),
        "recv_counts given": lambda x, c: plain.alltoallv(x, c, recv_counts=recv),
        "default (exchange+fingerprint)": lambda x, c: plain.alltoallv(x, c),
        "COMMLIB_CHECK=1": lambda x, c: checked.alltoallv(x, c),
        "COMMLIB_CHECK=1, recv_counts given": lambda x, c: checked.alltoallv(x, c, recv),
    }


def allreduce_contenders(plain: commlib.Communicator, checked: commlib.Communicator,
                         raw: MPI.Comm) -> Dict[str, Callable]:
    def by_hand(x, _counts):
        out = np.empty_like(x)
        raw.Allreduce(x, out)
        return out
    return {
        "mpi4py": by_hand,
        "default": lambda x, _c: plain.allreduce(x),
        "COMMLIB_CHECK=1": lambda x, _c: checked.allreduce(x),
    }


def time_all(contenders: Dict[str, Callable], x: np.ndarray, counts: np.ndarray,
             primers: int, seconds: float, world: MPI.Comm) -> Dict[str, float]:
    """Median microseconds per contender."""
    calls = list(contenders.values())
    warm = time_interleaved(calls, x, counts, 3, primers, world)
    iters = auto_iters(warm, primers, seconds)
    times = time_interleaved(calls, x, counts, iters, primers, world)
    return dict(zip(contenders, (np.median(times, axis=0) * 1e6).tolist()))


@click.command()
@click.option("--sizes", default=",".join(SIZES), show_default=True,
              help="Bytes per rank, comma-separated (K, M suffixes).")
@click.option("--primers", default=3, show_default=True)
@click.option("--seconds", default=2.0, show_default=True, help="Time budget per row.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(sizes: str, primers: int, seconds: float, json_path: Optional[str]) -> None:
    """Cost of commlib's checks at each size; run under mpiexec."""
    world = MPI.COMM_WORLD
    plain, checked = commlib.init(backend="mpi"), commlib.init(backend="mpi", check=True)
    raw = world.Dup()
    say = print if world.Get_rank() == 0 else (lambda *a, **k: None)
    rows: List[dict] = []
    say(f"reliability cost: {world.Get_size()} ranks; median us (ratio to mpi4py)")
    for nbytes in (parse_size(s) for s in sizes.split(",")):
        x = make_rows(nbytes // 1024, world.Get_rank())
        counts = send_counts("uniform", x.shape[0], world.Get_size(), world.Get_rank(), 0)
        recv = np.empty_like(counts)
        raw.Alltoall(counts, recv)
        for name, contenders, data in (
                ("alltoallv", alltoallv_contenders(plain, checked, raw, recv), x),
                ("allreduce", allreduce_contenders(plain, checked, raw), x.reshape(-1))):
            us = time_all(contenders, data, counts, primers, seconds, world)
            base = us["mpi4py"]
            rows.append({"op": name, "bytes_per_rank": nbytes, "us": us})
            say(f"{name} {nbytes:>10} B: " + "; ".join(
                f"{k} {v:.1f} ({v / base:.2f})" for k, v in us.items()), flush=True)
    write_json(json_path, {"ranks": world.Get_size(), "rows": rows}, world.Get_rank())
    raw.Free()
    checked.free()
    plain.free()


if __name__ == "__main__":
    main()
