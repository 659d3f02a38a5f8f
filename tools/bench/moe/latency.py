"""``moe latency``: the fixed cost of commlib's ``alltoall`` and
``alltoallv`` against mpi4py's calls of the same bytes."""

from __future__ import annotations

import functools
from typing import Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib.tools.bench.moe.baselines import counted_exchange
from commlib.tools.bench.timing import interleaved, json_option, repeated, write_json


@click.command()
@click.option("--sizes", default="1K,64K", show_default=True,
              help="Bytes per destination, comma-separated (K = 1024).")
@click.option("--repeat", default=200, show_default=True, help="Calls per timed unit.")
@click.option("--iters", default=15, show_default=True)
@json_option
def latency(sizes: str, repeat: int, iters: int, json_path: Optional[str]) -> None:
    """The fixed cost of a call: commlib's alltoall / alltoallv against
    mpi4py's Alltoall / count exchange + Alltoallv, same bytes."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    size = comm.size
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_moe latency: {size} ranks, {repeat} calls a unit, median of {iters} units, "
        f"slowest rank")
    rows = []
    for text in sizes.split(","):
        per_peer = int(text.upper().replace("K", "")) * (1024 if "K" in text.upper() else 1)
        x = np.ones((size, per_peer // 4), np.float32)
        out = np.empty_like(x)
        counts = np.full(size, 1, np.int64)

        contenders = {
            "mpi4py Alltoall": repeated(functools.partial(raw.Alltoall, x, out), repeat),
            "commlib alltoall": repeated(functools.partial(comm.alltoall, x), repeat),
            "mpi4py counts + Alltoallv": repeated(counted_exchange(raw, x, counts), repeat),
            "commlib alltoallv": repeated(functools.partial(comm.alltoallv, x, counts), repeat),
            "commlib alltoallv (recv counts given)":
                repeated(functools.partial(comm.alltoallv, x, counts, counts), repeat),
        }
        times = {name: float(np.median(t)) / repeat * 1e6
                 for name, t in interleaved(world, contenders, iters).items()}
        gaps = {"commlib alltoall": "mpi4py Alltoall",
                "commlib alltoallv": "mpi4py counts + Alltoallv",
                "commlib alltoallv (recv counts given)": "mpi4py counts + Alltoallv"}
        say(f"-- {text} per destination")
        for name, micros in times.items():
            baseline = gaps.get(name)
            gap = f"  (+{micros - times[baseline]:.1f} us over {baseline})" if baseline else ""
            rows.append({"bytes_per_destination": per_peer, "contender": name, "us": micros,
                         "gap_us": micros - times[baseline] if baseline else 0.0})
            say(f"{name:>38}: {micros:7.1f} us{gap}", flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()
