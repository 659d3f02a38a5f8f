"""How the benchmarks time, in one place: the slowest rank of a call from a
barrier, the best of repeats, interleaved rounds (the machine's drift hits
every contender alike), a one-process baseline on rank 0 while the other
ranks sleep, and the ``--json`` option with its report (rank 0 writes)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

import click
import numpy as np

if TYPE_CHECKING:  # mpi4py.MPI is imported where a rank is timed: importing it starts MPI
    from mpi4py import MPI

# auto_iters never goes below or above these
MIN_AUTO_ITERS = 10
MAX_AUTO_ITERS = 1000


# -- the slowest rank --------------------------------------------------------------
def slowest(world: MPI.Comm, call: Callable[[], object]) -> float:
    """Seconds of the slowest rank for one call, after a barrier."""
    from mpi4py import MPI

    world.Barrier()
    start = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - start, op=MPI.MAX)


def best_slowest(world: MPI.Comm, call: Callable[[], object], repeats: int) -> float:
    """Best over ``repeats`` of the slowest rank's time, interleaving-safe."""
    best = float("inf")
    for _ in range(repeats):
        best = min(best, slowest(world, call))
    return best


def best_local(call: Callable[[], object], repeats: int,
               sync: Callable[[], object] = lambda: None) -> float:
    """This process's fastest of ``repeats`` calls, ``sync`` (a device's)
    before and after each; the warm-up, if any, is the caller's."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def repeated(call: Callable[[], Any], times: int) -> Callable[[], None]:
    """``call`` ``times`` times: one timed unit for microsecond calls."""
    def run() -> None:
        for _ in range(times):
            call()
    return run


# -- interleaved rounds ---------------------------------------------------------------
def interleaved_medians(world: MPI.Comm, calls: List[Callable[[], object]],
                        repeats: int) -> List[float]:
    """Median time of each call, the calls alternating within every round."""
    times: List[List[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            times[i].append(slowest(world, call))
    return [float(np.median(t)) for t in times]


def interleaved(world: MPI.Comm, contenders: Dict[str, Callable[[], Any]], iters: int,
                warmup: int = 1) -> Dict[str, List[float]]:
    """Each contender ``iters`` times, in turns, after ``warmup`` untimed
    rounds: the slowest rank's seconds per call."""
    for _ in range(warmup):
        for call in contenders.values():
            call()
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(iters):
        for name, call in contenders.items():
            times[name].append(slowest(world, call))
    return times


def time_interleaved(contenders: Sequence[Callable[[Any, Any], object]], x: np.ndarray,
                     counts: np.ndarray, iters: int, primers: int,
                     world: MPI.Comm) -> np.ndarray:
    """[iters, contenders] seconds: the slowest rank's time of each timed
    call ``contender(x, counts)``.

    In each iteration every contender makes ``primers`` untimed calls, then
    a Barrier, then the timed call. On these machines the MPI calls right
    after a gloo call run slow: the first one 2-4x its steady time, the
    second 20-35% over, the fourth still 4-10% over. The primers absorb most
    of that, and the first two contenders (commlib, mpi4py) swap places
    every iteration so that the rest falls on both alike. One Allreduce at
    the end, not one per call, keeps reductions out of the timed stretch."""
    from mpi4py import MPI

    local = np.empty((iters, len(contenders)))
    for i in range(iters):
        order = list(range(len(contenders)))
        if i % 2 and len(order) > 1:
            order[:2] = order[1::-1]
        for j in order:
            for _ in range(primers):
                contenders[j](x, counts)
            world.Barrier()
            start = time.perf_counter()
            contenders[j](x, counts)
            local[i, j] = time.perf_counter() - start
    result = np.empty_like(local)
    world.Allreduce(local, result, op=MPI.MAX)
    return result


def auto_iters(warmup_seconds: np.ndarray, primers: int, budget: float) -> int:
    """Iterations that fill ``budget`` seconds, judged from the warm-up;
    identical on all ranks, the warm-up times being reduced already."""
    per_iter = (primers + 1) * float(np.median(warmup_seconds, axis=0).sum())
    return int(np.clip(budget / max(per_iter, 1e-9), MIN_AUTO_ITERS, MAX_AUTO_ITERS))


# -- a one-process baseline ------------------------------------------------------------
def idle_barrier(world: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so that a rank waiting for
    rank 0 leaves its core to rank 0's threads."""
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def first_rank_alone(world: MPI.Comm, call: Callable[[], object]) -> object:
    """``call()`` on rank 0 while the other ranks sleep in ``idle_barrier``
    (a one-process baseline gets every core); its result on every rank."""
    result = call() if world.Get_rank() == 0 else None
    idle_barrier(world)
    return world.bcast(result, root=0)


# -- the JSON report ----------------------------------------------------------------------
json_option = click.option("--json", "json_path", type=click.Path(dir_okay=False),
                           default=None, help="Write the rows here (rank 0).")


def write_json(json_path: Optional[str], data: object, rank: int = 0, indent: int = 1,
               default: Optional[Callable[[Any], Any]] = None) -> None:
    """``data`` as JSON at ``json_path``, from rank 0 (no path: nothing)."""
    if json_path and rank == 0:
        with open(json_path, "w") as f:
            json.dump(data, f, indent=indent, default=default)
