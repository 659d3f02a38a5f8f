"""An MoE layer under skewed routing, with and without redundant experts
(issue 45): does a rebalanced placement bring the step back to the time of
uniform routing?

    mpiexec -n 2 python -m commlib.tools.bench.placement
    mpiexec -n 4 python -m commlib.tools.bench.placement

The layer is dispatch, the experts, combine (torch float32, one thread per
rank), with identity experts (the communication alone) and with a small MLP
per logical expert (the same weights on every rank; a rank runs slot j's rows
through the MLP of logical expert ``placement.slots[rank][j]``). Each token
draws its top-k in proportion to the experts' popularity
(``simulate.popularity_routing``): uniform, then Zipf with each ``--zipf``
exponent (shuffled by the seed) through the identity placement and through
``moe.rebalance`` of the load one identity dispatch measured, with
``--redundant`` replicas (default one per rank). Every layer of one expert
kind is timed in the same interleaved rounds (the slowest rank per step, the
median reported) and its step set against the uniform routing's. Busiest/mean
is measured (each rank's tokens, as the replica rule shares them out token
by token) beside the rebalancer's prediction (each expert's load split
evenly over its replicas). The rebalanced layer's output is checked against
the identity layer's.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.timing import interleaved, json_option, write_json
from commlib.tools.diag.moe import rank_load
from commlib.tools.simulate import popularity_routing, zipf_popularity

KINDS = ("identity", "mlp")


class Layer:
    """One MoE layer: a routing, a placement and its Dispatcher."""

    def __init__(self, comm: commlib.Communicator, x: Any, experts: np.ndarray,
                 weights: np.ndarray, placement: moe.Placement, mlp: Sequence[Any]) -> None:
        import torch

        self.x, self.mlp = x, mlp
        self.experts, self.weights = torch.from_numpy(experts), torch.from_numpy(weights)
        self.placement = placement
        self.slots = placement.slots[comm.rank].tolist()
        self.dispatcher = moe.Dispatcher(comm, placement.num_logical, placement=placement)
        _, handle = self.dispatcher.dispatch(self.x, self.experts, self.weights)
        self.stats = handle.stats

    def step(self, kind: str) -> Any:
        """Dispatch, ``kind`` experts on this rank's slots, combine."""
        import torch

        expert_x, handle = self.dispatcher.dispatch(self.x, self.experts, self.weights)
        if kind == "mlp":
            w_in, w_out = self.mlp
            chunks = torch.split(expert_x, handle.tokens_per_expert.tolist())
            expert_x = torch.cat([torch.relu(rows @ w_in[e]) @ w_out[e]
                                  for e, rows in zip(self.slots, chunks)])
        return self.dispatcher.combine(expert_x, handle)


def layers(comm: commlib.Communicator, tokens: int, hidden: int, ffn: int, num_experts: int,
           topk: int, zipf: Sequence[float], redundant: int,
           seed: int) -> Dict[str, Layer]:
    """The contenders by name: uniform routing, then per Zipf exponent the
    identity placement and the rebalanced one."""
    import torch

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    mlp = (torch.randn(num_experts, hidden, ffn, generator=generator) / hidden ** 0.5,
           torch.randn(num_experts, ffn, hidden, generator=generator) / ffn ** 0.5)
    rng = np.random.default_rng([seed, comm.rank, 1])
    x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32))
    identity = moe.Placement.identity(num_experts, comm.size)

    def layer(popularity: np.ndarray, placement: moe.Placement) -> Layer:
        experts, weights = popularity_routing(comm.rank, tokens, popularity, topk, seed)
        return Layer(comm, x, experts, weights, placement, mlp)

    found = {"uniform": layer(np.ones(num_experts), identity)}
    for s in zipf:
        popularity = zipf_popularity(num_experts, s, seed)
        plain = found[f"zipf {s}"] = layer(popularity, identity)
        placement = moe.rebalance(plain.stats.tokens_per_expert, ranks=comm.size,
                                  redundant=redundant)
        found[f"zipf {s} rebalanced"] = layer(popularity, placement)
    return found


def check_outputs(found: Dict[str, Layer], zipf: Sequence[float]) -> None:
    """A rebalanced layer computes what the identity placement does."""
    for s in zipf:
        for kind in KINDS:
            want, got = (found[name].step(kind) for name in (f"zipf {s}",
                                                               f"zipf {s} rebalanced"))
            if not np.allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5):
                raise AssertionError(f"zipf {s}, {kind} experts: the rebalanced placement's "
                                     f"output differs from the identity placement's")


def rows(found: Dict[str, Layer], medians: Dict[str, Dict[str, float]],
         size: int) -> List[Dict[str, Any]]:
    """One row per expert kind and layer, its step against uniform routing's."""
    out = []
    for kind in KINDS:
        for name, layer in found.items():
            placement = layer.placement
            out.append({
                "experts": kind, "layer": name,
                "redundant": placement.num_physical - placement.num_logical,
                "seconds": medians[kind][name],
                "ratio_to_uniform": medians[kind][name] / medians[kind]["uniform"],
                **rank_load(layer.stats, size),
                "predicted_rank_imbalance": placement.imbalance(layer.stats.tokens_per_expert),
            })
    return out


@click.command()
@click.option("--tokens", default=2048, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=256, show_default=True)
@click.option("--ffn", default=512, show_default=True, help="The expert MLP's inner width.")
@click.option("--experts", "num_experts", default=16, show_default=True)
@click.option("--topk", default=2, show_default=True)
@click.option("--zipf", default="1.0,1.2", show_default=True,
              help="Zipf exponents of the expert popularity, comma-separated.")
@click.option("--redundant", type=click.IntRange(min=0), default=None,
              help="Replicas the rebalanced placement adds. Default: one per rank.")
@click.option("--iters", default=9, show_default=True, help="Interleaved timed rounds.")
@click.option("--seed", default=0, show_default=True)
@json_option
def main(tokens: int, hidden: int, ffn: int, num_experts: int, topk: int, zipf: str,
         redundant: Optional[int], iters: int, seed: int, json_path: Optional[str]) -> None:
    """An MoE layer: uniform routing, Zipf routing, Zipf with replicas."""
    exponents = [float(s) for s in zipf.split(",")]
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say: Callable[..., None] = print if comm.rank == 0 else (lambda *a, **k: None)
    found = layers(comm, tokens, hidden, ffn, num_experts, topk, exponents,
                   comm.size if redundant is None else redundant, seed)
    check_outputs(found, exponents)
    medians = {kind: {name: float(np.median(t)) for name, t in interleaved(
        world, {name: (lambda layer=layer, kind=kind: layer.step(kind))
                for name, layer in found.items()}, iters).items()}
        for kind in KINDS}
    table = rows(found, medians, comm.size)
    say(f"bench_placement: {comm.size} ranks; {tokens} tokens x {hidden} float32 per rank, "
        f"{num_experts} experts top-{topk}; MLP experts {hidden}->{ffn}->{hidden}, torch one "
        f"thread; median of {iters} interleaved rounds, slowest rank")
    say(f"{'experts':<9} {'layer':<20} {'redundant':>9} {'step (ms)':>10} {'x uniform':>10} "
        f"{'busiest/mean':>13} {'predicted':>10}")
    for row in table:
        say(f"{row['experts']:<9} {row['layer']:<20} {row['redundant']:>9} "
            f"{row['seconds'] * 1e3:>10.2f} {row['ratio_to_uniform']:>10.2f} "
            f"{row['rank_imbalance']:>13.3f} {row['predicted_rank_imbalance']:>10.3f}")
    write_json(json_path, table, comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
