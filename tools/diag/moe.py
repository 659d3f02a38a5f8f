"""``commlib diag moe`` (or ``python -m commlib.tools.diag.moe``): time MoE
dispatch + combine on this launch and report the traffic it caused.

    COMMLIB_RANKS_PER_NODE=2 mpiexec -n 4 python -m commlib.tools.diag.moe --hierarchical

Each rank routes seeded synthetic logits (``simulate.synthetic_routing``:
standard normal logits plus a ``--skew`` popularity bias towards low expert
ids, softmax score), then dispatches host rows through
``commlib.moe.Dispatcher`` to identity experts and combines them back, so the
times are the communication path alone. Rank 0 prints tokens/s and, from the
dispatch's ``DispatchStats``, the bytes between and inside nodes and the
tokens each rank's experts received. With the same configuration, ``commlib
simulate`` predicts those bytes exactly.

A skewed routing instead: ``--zipf S`` (expert popularity Zipf-distributed
with exponent S, shuffled by the seed) or ``--load-matrix FILE`` (one load
per expert, .npy or text); each token then draws its top-k in proportion to
the popularity (``simulate.popularity_routing``). ``--placement rebalance``
then feeds the measured load per expert to ``commlib.moe.rebalance``
(``--redundant`` replicas, default one per rank; hierarchical under
``--topk-groups``), times dispatch + combine again through that placement,
and prints each rank's tokens before (the identity placement) and after.

``--fp8`` sends the rows as e4m3 with a float32 scale per 128 channels (the
experts get them dequantized to x's dtype); ``--fixed-capacity`` dispatches
sync-free into fixed slots (``max_tokens_per_rank=--tokens``), its stats
collected after the timed loop. Both move the same tokens, so the bytes
differ from the plain run's only by the row size.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Tuple

import click
import numpy as np

import commlib
from commlib.moe import Dispatcher, DispatchStats, Placement, rebalance
from commlib.moe.quantize import BLOCK
from commlib.tools.cluster import parse_rate
from commlib.tools.simulate import (
    DTYPES,
    SCORE,
    parse_dtype,
    popularity_routing,
    synthetic_routing,
    zipf_popularity,
)
from commlib.tools.world import world
from commlib.topology import Topology


@dataclass(frozen=True)
class Settings:
    """The command's options, as they go into the JSON report."""

    experts: int
    topk: int
    tokens: int
    hidden: int
    dtype: str
    skew: float
    zipf: Optional[float]
    load_matrix: Optional[str]
    topk_groups: Optional[int]
    capacity_factor: Optional[float]
    hierarchical: bool
    fp8: bool
    fixed_capacity: bool
    placement: str
    redundant: Optional[int]
    pipeline_chunks: Optional[int]
    link_rate: Optional[str]
    iters: int
    seed: int

    @property
    def quantize(self) -> Optional[str]:
        """The Dispatcher's ``quantize`` argument."""
        return "fp8" if self.fp8 else None

    @property
    def row_bytes(self) -> int:
        """Payload bytes of one row on the wire: x's dtype, or an e4m3 byte
        per channel plus a float32 scale per ``BLOCK`` channels."""
        if self.fp8:
            return self.hidden + 4 * math.ceil(self.hidden / BLOCK)
        return parse_dtype(self.dtype).itemsize * self.hidden


@dataclass(frozen=True)
class Measurement:
    """What the timed loop saw: each iteration's seconds on the slowest
    rank, one dispatch's stats, and (fixed capacity) expert_x's slots per
    local expert."""

    times: np.ndarray
    stats: DispatchStats
    slots_per_expert: Optional[int]


def check_usage(settings: Settings, size: int, topology: Topology) -> None:
    """Usage errors (exit 2). Every rank decides from the same facts (the
    options, the world size, the topology every rank agrees on), so all of
    them exit together before any data moves and none is left waiting."""
    nodes = topology.num_nodes
    if settings.experts % size:
        raise click.BadParameter(f"{settings.experts} experts cannot be spread evenly over "
                                 f"{size} ranks; use a multiple of {size}",
                                 param_hint="'--experts'")
    if settings.topk > settings.experts:
        raise click.BadParameter(f"top-{settings.topk} is impossible with {settings.experts} "
                                 f"experts; use at most {settings.experts}",
                                 param_hint="'--topk'")
    if settings.fixed_capacity and settings.tokens == 0:
        raise click.BadParameter("needs --tokens of at least 1 (it is max_tokens_per_rank, "
                                 "which sizes the slots)", param_hint="'--fixed-capacity'")
    if settings.redundant is not None and settings.placement != "rebalance":
        raise click.BadParameter("counts the replicas a rebalanced placement adds; give "
                                 "--placement rebalance too", param_hint="'--redundant'")
    per_node = {len(topology.ranks_of(n)) for n in range(nodes)}
    if settings.placement == "rebalance" and len(per_node) > 1:
        raise click.BadParameter(f"a placement needs the same number of ranks on every node; "
                                 f"these nodes have {sorted(per_node)}",
                                 param_hint="'--placement'")
    if settings.topk_groups is None:
        return
    if settings.topk_groups > nodes:
        raise click.BadParameter(f"{settings.topk_groups} exceeds the {nodes} node(s) (one "
                                 f"expert group per node); use 1..{nodes}",
                                 param_hint="'--topk-groups'")
    per_node = settings.experts // nodes
    if settings.topk > settings.topk_groups * per_node:
        raise click.BadParameter(f"top-{settings.topk} does not fit in {settings.topk_groups} "
                                 f"node(s) of {per_node} experts; use at least "
                                 f"{-(-settings.topk // per_node)}", param_hint="'--topk-groups'")


def popularity_of(settings: Settings) -> Optional[np.ndarray]:
    """The expert popularity that ``--zipf`` or ``--load-matrix`` gives, or
    None for ``--skew``'s logits; usage errors (exit 2) for two routings at
    once and for a load file that is not one finite, non-negative value per
    expert, not all 0. Every rank reads the file, before MPI starts."""
    given = [name for name, chosen in (("--skew", settings.skew != 0),
                                       ("--zipf", settings.zipf is not None),
                                       ("--load-matrix", settings.load_matrix is not None))
             if chosen]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)} are each a routing; give one")
    if settings.zipf is not None:
        return zipf_popularity(settings.experts, settings.zipf, settings.seed)
    if settings.load_matrix is None:
        return None
    hint = "'--load-matrix'"
    try:
        load = (np.load(settings.load_matrix) if settings.load_matrix.endswith(".npy")
                else np.loadtxt(settings.load_matrix, ndmin=1))
    except (OSError, ValueError) as error:
        raise click.BadParameter(f"cannot read {settings.load_matrix} as a .npy or text "
                                 f"array: {error}", param_hint=hint) from None
    if load.shape != (settings.experts,):
        raise click.BadParameter(f"{settings.load_matrix} must hold one load per expert, "
                                 f"{settings.experts} (--experts) values; it has shape "
                                 f"{load.shape}", param_hint=hint)
    if not (load.dtype.kind in "iuf" and np.isfinite(load).all()
            and (load >= 0).all() and load.sum() > 0):
        raise click.BadParameter(f"{settings.load_matrix}: the loads must be finite, "
                                 f"non-negative and not all 0", param_hint=hint)
    return load.astype(np.float64)


def check_plot_available(plot: Optional[str]) -> None:
    """--plot needs matplotlib; say so before MPI starts, not after the run."""
    if plot and importlib.util.find_spec("matplotlib") is None:
        raise click.UsageError("--plot needs matplotlib, which is not installed: "
                               "pip install matplotlib (or drop --plot)")


def time_dispatch(comm: commlib.Communicator, dispatcher: Dispatcher, x: np.ndarray,
                  experts: np.ndarray, weights: np.ndarray, iters: int,
                  quantize: Optional[str]) -> Measurement:
    """Time dispatch + combine. One untimed round first warms the buffers;
    each timed one starts at a barrier so it measures the exchange, not rank
    skew. Identity experts: combine takes expert_x as it arrives (FP8 rows
    dequantized to x's dtype; a fixed capacity's [L, slots, H] as is)."""
    def round_trip() -> Tuple[Any, Any]:
        expert_x, handle = dispatcher.dispatch(x, experts, weights, quantize=quantize,
                                               dequantize=True)
        dispatcher.combine(expert_x, handle)
        return expert_x, handle

    round_trip()
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        comm.barrier()
        start = time.perf_counter()
        expert_x, handle = round_trip()
        times[i] = time.perf_counter() - start
    slowest = comm.allreduce(times, op="max")
    if handle.stats is not None:
        return Measurement(slowest, handle.stats, None)
    # fixed capacity: the stats wait on the device until collected, outside
    # the timed loop
    return Measurement(slowest, per_dispatch(dispatcher.collect_stats(), iters + 1),
                       int(expert_x.shape[1]))


def per_dispatch(total: DispatchStats, dispatches: int) -> DispatchStats:
    """One dispatch's stats from ``collect_stats``' sum over ``dispatches``
    of them, as the counted mode reports: every dispatch here sends the same
    rows, so each field divides exactly."""
    return DispatchStats(*(getattr(total, field.name) // dispatches
                           for field in fields(total)))


def report(settings: Settings, comm: commlib.Communicator,
           measured: Measurement) -> Dict[str, Any]:
    """The numbers rank 0 prints and writes: totals over all ranks for one
    dispatch; bytes per token is payload sent (both links) per routed token;
    times of the slowest rank per iteration (seconds_per_iter: the median)."""
    total_tokens = settings.tokens * comm.size
    stats = measured.stats
    sent = stats.inter_node_bytes + stats.intra_node_bytes
    topology = comm.topology
    times = timing(measured.times)
    seconds = times["seconds_per_iter"]
    limit = (link_limit(stats.traffic, topology, parse_rate(settings.link_rate))
             if settings.link_rate else None)
    return {
        "tokens_per_s": total_tokens / seconds if seconds > 0 else float("inf"),
        "link_limit_s": limit,
        **times,
        "quantize": settings.quantize,
        "fixed_capacity": settings.fixed_capacity,
        "slots_per_expert": measured.slots_per_expert,
        "payload_bytes_per_row": settings.row_bytes,
        "inter_node_bytes": stats.inter_node_bytes,
        "intra_node_bytes": stats.intra_node_bytes,
        "bytes_per_token": sent / total_tokens if total_tokens else 0.0,
        "imbalance": stats.imbalance,
        "dropped": int(stats.dropped.sum()),
        "tokens_per_expert": stats.tokens_per_expert.tolist(),
        **rank_load(stats, comm.size),
        "traffic": stats.traffic.tolist(),
        "placement": None,
        "config": dict(asdict(settings), score=SCORE, world_size=comm.size,
                       nodes=topology.num_nodes, emulated_nodes=topology.emulated,
                       ranks_per_node=[len(topology.ranks_of(n))
                                       for n in range(topology.num_nodes)]),
    }


def timing(times: np.ndarray) -> Dict[str, float]:
    """The slowest rank's seconds per iteration: the median (p50) and p99."""
    seconds, p99 = (float(t) for t in np.percentile(times, [50, 99]))
    return {"seconds_per_iter": seconds, "time_us_p50": seconds * 1e6, "time_us_p99": p99 * 1e6}


def rank_load(stats: DispatchStats, size: int) -> Dict[str, Any]:
    """The tokens each rank's experts received in one dispatch (its slots'
    ``tokens_per_slot`` summed), and the busiest rank's over the mean's."""
    per_rank = stats.tokens_per_slot.reshape(size, -1).sum(1)
    mean = per_rank.mean()
    return {"tokens_per_rank": per_rank.tolist(),
            "rank_imbalance": float(per_rank.max() / mean) if mean > 0 else 1.0}


def placement_report(placement: Placement, groups: Optional[int], load: np.ndarray,
                     measured: Measurement) -> Dict[str, Any]:
    """The rebalanced placement and what its timed loop saw: the report's
    ``placement`` entry. ``predicted_rank_imbalance`` is the rebalancer's
    own measure (each expert's load split evenly over its replicas); the
    measured one is what the replica rule sent, token by token."""
    stats = measured.stats
    return {
        "policy": "rebalance",
        "packing": "hierarchical" if groups is not None and placement.nodes > 1 else "global",
        "redundant": placement.num_physical - placement.num_logical,
        "slots_per_rank": placement.slots_per_rank,
        "physical_to_logical": placement.physical_to_logical.tolist(),
        "predicted_rank_imbalance": placement.imbalance(load),
        **timing(measured.times),
        "slots_per_expert": measured.slots_per_expert,
        "inter_node_bytes": stats.inter_node_bytes,
        "intra_node_bytes": stats.intra_node_bytes,
        "dropped": int(stats.dropped.sum()),
        "tokens_per_slot": stats.tokens_per_slot.tolist(),
        **rank_load(stats, placement.ranks),
    }


def link_limit(traffic: np.ndarray, topology: Topology, bits_per_s: int) -> float:
    """Seconds one dispatch + combine needs at least on links of
    ``bits_per_s`` each way: the busiest node's bytes out of it or into it
    (payload, ``traffic`` [source, destination]) over the rate, twice
    (combine sends the same rows back)."""
    node = np.array([topology.node_of(r) for r in range(topology.size)])
    busiest = 0
    for n in range(topology.num_nodes):
        inside = node == n
        busiest = max(busiest, int(traffic[np.ix_(inside, ~inside)].sum()),
                      int(traffic[np.ix_(~inside, inside)].sum()))
    return 2 * busiest * 8 / bits_per_s


def summary_lines(result: Dict[str, Any]) -> List[str]:
    """The human-readable report, one fact per line."""
    config = result["config"]
    routing = (f"node-limited ({config['topk_groups']} of {config['nodes']} nodes)"
               if config["topk_groups"] else "top-k")
    path = "two-hop" if config["hierarchical"] else "flat"
    rows = (f"fp8 (e4m3 + float32 scale per {BLOCK} channels, dequantized to "
            f"{config['dtype']} for the experts)" if result["quantize"] else config["dtype"])
    layout = (f"fixed capacity, {result['slots_per_expert']} slots per local expert, "
              f"stats collected after the loop" if result["fixed_capacity"]
              else "counted (the host reads the counts every dispatch)")
    return [
        f"# commlib diag moe: {_plural(config['world_size'], 'rank')}, "
        f"{_plural(config['nodes'], 'node')}{' (emulated)' if config['emulated_nodes'] else ''}"
        f", ranks per node {','.join(map(str, config['ranks_per_node']))}",
        f"# experts {config['experts']} top-{config['topk']} {routing}, {path} dispatch, "
        f"{config['tokens']} tokens/rank, hidden {config['hidden']} {config['dtype']}, "
        f"{_popularity(config)}, capacity factor {config['capacity_factor']}",
        f"# rows {rows}, {result['payload_bytes_per_row']} B/row; {layout}",
        f"time per dispatch+combine  {result['seconds_per_iter'] * 1e3:.3f} ms "
        f"(median of {config['iters']}, slowest rank; p99 "
        f"{result['time_us_p99'] / 1e3:.3f} ms)",
        *([f"link limit                 {result['link_limit_s'] * 1e3:.3f} ms at "
           f"{config['link_rate']} (measured {ratio:.2f}x it)"]
          if (ratio := _over(result['seconds_per_iter'], result['link_limit_s'])) else []),
        f"tokens/s                   {result['tokens_per_s']:.4g}",
        f"inter_node_bytes           {result['inter_node_bytes']}",
        f"intra_node_bytes           {result['intra_node_bytes']}",
        f"bytes per token            {result['bytes_per_token']:.1f}",
        f"imbalance                  {result['imbalance']:.3f}",
        f"dropped                    {result['dropped']}",
        *rank_load_lines(result),
    ]


def rank_load_lines(result: Dict[str, Any]) -> List[str]:
    """Each rank's tokens in a column for the identity placement and, with
    --placement rebalance, one for the rebalanced placement beside it, with
    its time, bytes and drops."""
    columns = [result] + ([result["placement"]] if result["placement"] else [])
    placed = result["placement"]

    def row(name: str, values: List[Any]) -> str:
        return f"{name:<26}" + "".join(f"{value:>13}" for value in values)
    lines = []
    if placed:
        lines.append(f"# placement rebalance ({placed['packing']}): {placed['redundant']} "
                     f"redundant, {placed['slots_per_rank']} slots per rank, from the load "
                     f"measured above; busiest/mean predicted "
                     f"{placed['predicted_rank_imbalance']:.3f} (each expert's load split "
                     f"evenly over its replicas)")
    lines.append("#" + row("", ["identity", "rebalanced"][:len(columns)])[1:])
    if placed:
        lines += [row("time (ms)", [f"{c['seconds_per_iter'] * 1e3:.3f}" for c in columns]),
                  row("inter_node_bytes", [c["inter_node_bytes"] for c in columns]),
                  row("intra_node_bytes", [c["intra_node_bytes"] for c in columns]),
                  row("dropped", [c["dropped"] for c in columns])]
    lines.append(row("busiest/mean rank", [f"{c['rank_imbalance']:.3f}" for c in columns]))
    lines += [row(f"tokens on rank {rank}", values)
              for rank, values in enumerate(zip(*(c["tokens_per_rank"] for c in columns)))]
    return lines


def _popularity(config: Dict[str, Any]) -> str:
    """The routing's popularity, as the header says it."""
    if config["zipf"] is not None:
        return f"zipf {config['zipf']} (shuffled by the seed)"
    if config["load_matrix"] is not None:
        return f"load from {config['load_matrix']}"
    return f"skew {config['skew']}"


def _over(seconds: float, limit: Optional[float]) -> Optional[float]:
    """``seconds`` over the link limit (None without one, or where nothing crosses)."""
    return seconds / limit if limit else None


def _plural(count: int, noun: str) -> str:
    """``1 rank``, ``4 ranks``."""
    return f"{count} {noun}{'s' if count != 1 else ''}"


def plot_traffic(traffic: np.ndarray, path: str) -> None:
    """Rank x rank bytes of one dispatch as a heatmap (sender rows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 5))
    image = axes.imshow(traffic, cmap="viridis")
    axes.set_xlabel("destination rank")
    axes.set_ylabel("source rank")
    axes.set_title("MoE dispatch traffic (bytes)")
    figure.colorbar(image, ax=axes)
    figure.savefig(path, bbox_inches="tight")
    plt.close(figure)


@click.command("moe", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--experts", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--topk", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--tokens", type=click.IntRange(min=0), default=4096, show_default=True,
              help="Tokens per rank.")
@click.option("--hidden", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True)
@click.option("--skew", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Popularity bias: logits + -skew*log(1+expert id).")
@click.option("--zipf", type=click.FloatRange(min=0), default=None,
              help="Expert popularity Zipf-distributed with this exponent (the i-th most "
                   "popular i**-S), shuffled by --seed; each token draws its top-k in "
                   "proportion. Instead of --skew.")
@click.option("--load-matrix", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Expert popularity from a saved load, one value per expert (.npy, else "
                   "text), e.g. DispatchStats.tokens_per_expert; drawn as with --zipf.")
@click.option("--topk-groups", type=click.IntRange(min=1), default=None,
              help="Nodes a token may use (group-limited routing, one group per node). "
                   "Default: plain top-k.")
@click.option("--capacity-factor", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Cap each expert at ceil(T*k/E*cf) tokens per source. Default: no cap.")
@click.option("--hierarchical", is_flag=True, help="Two-hop dispatch (node, then rank).")
@click.option("--fp8", is_flag=True,
              help=f"Rows travel as e4m3 + a float32 scale per {BLOCK} channels (the experts "
                   f"get them dequantized).")
@click.option("--fixed-capacity", is_flag=True,
              help="Sync-free fixed slots (max_tokens_per_rank = --tokens); stats collected "
                   "after the timed loop.")
@click.option("--placement", type=click.Choice(["none", "rebalance"]), default="none",
              show_default=True,
              help="rebalance: moe.rebalance the measured load per expert, time the run "
                   "again through that placement and print each rank's tokens beside the "
                   "identity placement's (hierarchical under --topk-groups).")
@click.option("--redundant", type=click.IntRange(min=0), default=None,
              help="Replicas the rebalanced placement adds, in all (rounded up to fill "
                   "every rank's slots). Default: one per rank.")
@click.option("--pipeline-chunks", type=click.IntRange(min=1), default=None,
              help="Chunks a two-hop dispatch cuts its inter-node hop into (1: not "
              "pipelined). Default: chosen from the bytes.")
@click.option("--link-rate", callback=lambda c, p, v: v and parse_rate(v) and v,
              help="Each node's link to the others, each direction, as tc writes it "
              "(300mbit): prints the link limit, the time the inter-node bytes of "
              "dispatch + combine need at that rate, beside the measured time.")
@click.option("--iters", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="Also write the report as JSON to this file (rank 0).")
@click.option("--plot", type=click.Path(dir_okay=False, writable=True),
              help="Also draw the rank x rank traffic as a PNG heatmap (needs matplotlib).")
def moe(json_path: Optional[str], plot: Optional[str], **options: Any) -> None:
    """Time MoE dispatch + combine (identity experts) on seeded synthetic
    routing and report tokens/s, bytes between and inside nodes, imbalance
    and drops for one dispatch. `commlib simulate` predicts the same bytes
    (with --fp8, scaled to FP8's row size)."""
    settings = Settings(**options)
    check_plot_available(plot)
    popularity = popularity_of(settings)
    with world() as comm:
        check_usage(settings, comm.size, comm.topology)
        result = run(comm, settings, popularity)
        if comm.rank == 0:
            click.echo("\n".join(summary_lines(result)))
            if json_path:
                with open(json_path, "w") as handle:
                    json.dump(result, handle, indent=2)
            if plot:
                plot_traffic(np.asarray(result["traffic"]), plot)


def run(comm: commlib.Communicator, settings: Settings,
        popularity: Optional[np.ndarray]) -> Dict[str, Any]:
    """Route this rank's tokens (``popularity``: drawn in proportion to it;
    None: --skew's logits), time the dispatch and build the report; with
    --placement rebalance, rebalance the measured load (the same stats on
    every rank, so the same placement) and time it again through that."""
    groups = None if settings.topk_groups is None else comm.topology.num_nodes
    if popularity is None:
        experts, weights = synthetic_routing(comm.rank, settings.tokens, settings.experts,
                                             settings.topk, settings.skew, settings.seed,
                                             groups, settings.topk_groups)
    else:
        experts, weights = popularity_routing(comm.rank, settings.tokens, popularity,
                                              settings.topk, settings.seed, groups,
                                              settings.topk_groups)
    rng = np.random.default_rng([settings.seed, comm.rank, 1])
    x = rng.standard_normal((settings.tokens, settings.hidden), dtype=np.float32)
    x = x.astype(parse_dtype(settings.dtype))

    def timed(placement: Optional[Placement]) -> Measurement:
        dispatcher = Dispatcher(comm, settings.experts,
                                capacity_factor=settings.capacity_factor,
                                hierarchical=settings.hierarchical,
                                max_tokens_per_rank=settings.tokens if settings.fixed_capacity
                                else None, placement=placement)
        dispatcher.pipeline_chunks = settings.pipeline_chunks
        return time_dispatch(comm, dispatcher, x, experts, weights, settings.iters,
                             settings.quantize)

    measured = timed(None)
    result = report(settings, comm, measured)
    if settings.placement == "rebalance":
        load = measured.stats.tokens_per_expert
        placement = rebalance(load, ranks=comm.size, nodes=comm.topology.num_nodes,
                              redundant=comm.size if settings.redundant is None
                              else settings.redundant, groups=groups)
        result["placement"] = placement_report(placement, groups, load, timed(placement))
    return result


if __name__ == "__main__":
    moe()
