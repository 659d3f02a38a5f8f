"""Flat against two-hop MoE dispatch across real hosts: the emulated
cluster (``commlib.tools.cluster``, root only) at each link rate, and
``commlib diag moe`` run as flat, two-hop in one exchange and two-hop
pipelined, in interleaved rounds; medians, each against flat and against
its link limit (the time its inter-host bytes need at the link's rate).

    python -m commlib.tools.bench_two_hop --rate 300mbit --rate unshaped
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import click

from commlib.tools.cluster import Cluster, ClusterError, parse_rate

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
                    sys.executable, "-m", "commlib.tools.diag_moe", *shape, *options, *limit,
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
        try:
            with Cluster(hosts, shaped) as cluster:
                reports = measure(cluster, ranks_per_host, shape.split(), shaped, rounds)
        except ClusterError as error:
            raise click.ClickException(str(error)) from None
        click.echo("\n".join(lines(rate, reports)))


if __name__ == "__main__":
    main()
