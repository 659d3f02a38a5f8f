"""The time of one rebalance: ``commlib.moe.move_expert_weights`` moving an
MLP layer's expert weights (w_in [hidden, ffn] and w_out [ffn, hidden] per
expert, float32) from a placement balanced for one Zipf load to the one
``rebalance`` chooses, from it, for another, against a bare
``comm.alltoallv`` of the same bytes with the same counts, and a plain
copy of this rank's weights (the result is new arrays: a floor the move
pays beside its exchange), and the move ``in_place`` (the changed slots
overwritten: the same bytes on the wire, no copy of the rest; repeated on
one buffer, whose values then no longer matter, only the work); the slowest
rank's median, interleaved.

    OMP_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.placement_moves
"""

from __future__ import annotations

import click
import numpy as np
from mpi4py import MPI

import commlib
import commlib.moe as moe
from commlib.tools.bench.timing import interleaved
from commlib.tools.simulate import zipf_popularity


class _Recording:
    """The communicator, remembering the counts of the alltoallv the move
    starts (``alltoallv_async``)."""

    def __init__(self, comm):
        self._comm, self.exchange = comm, None

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def alltoallv_async(self, x, send_counts, recv_counts=None):
        self.exchange = (x.shape, send_counts, recv_counts)
        return self._comm.alltoallv_async(x, send_counts, recv_counts)


@click.command()
@click.option("--experts", default=64, show_default=True)
@click.option("--hidden", default=256, show_default=True)
@click.option("--ffn", default=1024, show_default=True)
@click.option("--iters", default=7, show_default=True)
def main(experts: int, hidden: int, ffn: int, iters: int) -> None:
    """One placement change's weights moved, against a bare alltoallv."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    current = moe.rebalance(zipf_popularity(experts, 1.0, 1), ranks=comm.size, redundant=comm.size)
    new = moe.rebalance(zipf_popularity(experts, 1.0, 2), ranks=comm.size, redundant=comm.size,
                        current=current)
    rng = np.random.default_rng(comm.rank)
    slots = current.slots_per_rank
    weights = {"w_in": rng.standard_normal((slots, hidden, ffn), dtype=np.float32),
               "w_out": rng.standard_normal((slots, ffn, hidden), dtype=np.float32)}
    recording = _Recording(comm)
    moe.move_expert_weights(recording, weights, current, new)
    shape, send_counts, recv_counts = recording.exchange
    payload = np.zeros(shape, np.uint8)
    overwritten = {name: w.copy() for name, w in weights.items()}
    times = interleaved(world, {
        "move_expert_weights": lambda: moe.move_expert_weights(comm, weights, current, new),
        "in place": lambda: moe.move_expert_weights(comm, overwritten, current, new,
                                                    in_place=True),
        "bare alltoallv": lambda: comm.alltoallv(payload, send_counts, recv_counts),
        "copy of the weights": lambda: [w.copy() for w in weights.values()]}, iters)
    moved = world.allreduce(payload.nbytes)
    if comm.rank == 0:
        median = {name: float(np.median(t)) for name, t in times.items()}
        floor = median["bare alltoallv"] + median["copy of the weights"]
        expert_mb = 2 * hidden * ffn * 4 / 2**20
        print(f"placement_moves: {comm.size} ranks, {experts} experts of 2 x {hidden} x {ffn} "
              f"float32 ({expert_mb:.0f} MiB each), {current.slots_per_rank} slots per rank; "
              f"{len(moe.moves(current, new))} weights move, {moved / 2**20:.0f} MiB in all")
        for name, seconds in median.items():
            print(f"  {name:<20} {seconds * 1e3:8.1f} ms  ({moved / seconds / 1e9:.2f} GB/s)")
        print(f"  ratio {median['move_expert_weights'] / median['bare alltoallv']:.2f}x "
              f"the bare exchange, {median['move_expert_weights'] / floor:.2f}x the floor "
              f"(the copy and the bare exchange); in place "
              f"{median['in place'] / median['bare alltoallv']:.2f}x the bare exchange")
    comm.free()


if __name__ == "__main__":
    main()
