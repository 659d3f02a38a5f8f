"""Flat against two-hop MoE dispatch across real hosts: the emulated
cluster (``commlib.tools.cluster``, root only) at each link rate, and
``commlib diag moe`` run as flat, two-hop in one exchange and two-hop
pipelined, in interleaved rounds; medians, each against flat and against
its link limit (the time its inter-host bytes need at the link's rate).
Then ``commlib simulate``'s prediction for flat and two-hop, from the
fabric's rates as ``commlib diag alltoall`` measures them on the same
cluster (inside a host and between hosts), against the measured times.

    python -m commlib.tools.bench.two_hop --rate 300mbit --rate unshaped
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import click

from commlib.tools import simulate
from commlib.tools.cluster import Cluster, ClusterError, parse_rate
from commlib.tools.diag import moe as diag_moe

# name -> diag moe options
PATHS = {"flat": [], "two-hop, one exchange": ["--hierarchical", "--pipeline-chunks", "1"],
         "two-hop, pipelined": ["--hierarchical"]}


def measure(cluster: Cluster, ranks_per_host: int, shape: List[str], rate: Optional[str],
            rounds: int) -> Dict[str, List[dict]]:
    """Every path once per round, in turn; each run's diag moe report."""
    reports: Dict[str, List[dict]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "moe.json"
        for _ in range(rounds):
            for name, options in PATHS.items():
                limit = ["--link-rate", rate] if rate else []
                done = cluster.run(ranks_per_host, [
                    sys.executable, "-m", "commlib.tools.diag.moe", *shape, *options, *limit,
                    "--json", str(report)], capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise click.ClickException(f"diag moe {name} failed:\n{done.stderr[-2000:]}")
                reports[name].append(json.loads(report.read_text()))
    return reports


def lines(rate: str, reports: Dict[str, List[dict]]) -> List[str]:
    """One line per path: median time, its range, x flat, x its link limit."""
    def median(name: str) -> float:
        return statistics.median(r["seconds_per_iter"] for r in reports[name])
    flat = median("flat")
    out = []
    for name, runs in reports.items():
        seconds = [r["seconds_per_iter"] for r in runs]
        limit = runs[0]["link_limit_s"]
        against = f", {median(name) / limit:.2f}x its link limit ({limit * 1e3:.0f} ms)" \
            if limit else ""
        out.append(f"{rate:>9}  {name:<22} {median(name) * 1e3:8.1f} ms "
                   f"({min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f}), "
                   f"{flat / median(name):.2f}x faster than flat{against}; inter-host "
                   f"{runs[0]['inter_node_bytes'] / 1e6:.1f} MB")
    return out


def fabric_rates(cluster: Cluster, ranks_per_host: int) -> Tuple[float, float]:
    """GB/s each rank moves inside its host and between hosts, as ``diag
    alltoall`` reports them for 16 MiB per rank (each kind sent alone)."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "alltoall.json"
        done = cluster.run(ranks_per_host, [
            sys.executable, "-m", "commlib.tools.cli", "diag", "alltoall", "-b", "16M",
            "-e", "16M", "-n", "5", "-w", "1", "--json", str(report)],
            capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise click.ClickException(f"diag alltoall failed:\n{done.stderr[-2000:]}")
        row = json.loads(report.read_text())[-1]
    return row["inside_hosts"]["algbw_gbps"], row["between_hosts"]["algbw_gbps"]


def simulated(shape: List[str], hosts: int, ranks_per_host: int) -> Optional[simulate.Config]:
    """diag moe's ``shape`` as simulate describes it (the same routing and
    bytes); None for a fixed capacity, whose padding crosses too and
    simulate does not count, and for --zipf or --load-matrix, routings
    simulate does not draw."""
    options = diag_moe.moe.make_context("moe", list(shape)).params
    settings = diag_moe.Settings(**{name: options[name] for name in
                                    diag_moe.Settings.__dataclass_fields__})
    if settings.fixed_capacity or (settings.zipf, settings.load_matrix) != (None, None):
        return None
    return simulate.Config(simulate.Layout(hosts, ranks_per_host, settings.experts),
                           settings.topk, settings.tokens, settings.row_bytes, settings.skew,
                           settings.seed)


def predictions(config: simulate.Config, rates: Tuple[float, float]) -> Dict[str, float]:
    """simulate's seconds for one dispatch + combine (twice its dispatch),
    flat and two-hop, at ``rates`` (inside a host, between hosts)."""
    return {name: 2 * simulate.predict(config.traffic(None, hierarchical), config.layout,
                                       *rates).predicted_seconds
            for name, hierarchical in (("flat", False), ("two-hop", True))}


def prediction_lines(rate: str, rates: Tuple[float, float], predicted: Dict[str, float],
                     reports: Dict[str, List[dict]]) -> List[str]:
    """simulate against the measured medians (two-hop: the pipelined path)."""
    out = [f"{rate:>9}  simulate at the measured rates: inside a host {rates[0]:.3f} GB/s, "
           f"between hosts {rates[1]:.4f} GB/s per rank"]
    for name, path in (("flat", "flat"), ("two-hop", "two-hop, pipelined")):
        measured = statistics.median(r["seconds_per_iter"] for r in reports[path])
        out.append(f"{rate:>9}  {name:<22} predicted {predicted[name] * 1e3:8.1f} ms, measured "
                   f"{measured * 1e3:.1f} ms ({predicted[name] / measured - 1:+.0%})")
    return out


@click.command()
@click.option("--rate", "rates", multiple=True, default=("300mbit", "unshaped"),
              show_default=True, help="Link rates to run at (tc syntax, or 'unshaped').")
@click.option("--hosts", default=2, show_default=True)
@click.option("--ranks-per-host", default=2, show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--shape", default="--experts 32 --topk 8 --tokens 2048 --hidden 1024",
              show_default=True, help="diag moe's options for the problem.")
def main(rates: Tuple[str, ...], hosts: int, ranks_per_host: int, rounds: int,
         shape: str) -> None:
    """Flat vs two-hop dispatch on an emulated cluster, side by side."""
    for rate in rates:
        shaped = None if rate == "unshaped" else rate
        if shaped:
            parse_rate(shaped)
        config = simulated(shape.split(), hosts, ranks_per_host)
        try:
            with Cluster(hosts, shaped) as cluster:
                reports = measure(cluster, ranks_per_host, shape.split(), shaped, rounds)
                rates = fabric_rates(cluster, ranks_per_host) if config else None
        except ClusterError as error:
            raise click.ClickException(str(error)) from None
        click.echo("\n".join(lines(rate, reports)))
        if config:
            click.echo("\n".join(prediction_lines(rate, rates, predictions(config, rates),
                                                   reports)))


if __name__ == "__main__":
    main()
