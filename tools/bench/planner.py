"""The planner's pick against every split it priced, measured: for each
shape of a grid, forward+backward of ``hybrid_attention`` at every allowed
Ulysses degree and ring method (torch tensors, causal, zigzag), the plan's
pick (priced forward and backward), and pick / fastest (target <= 1.10).

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m commlib.tools.bench.planner \\
        --seq 8192 --seq 32768 --kv-heads 8 --kv-heads 1 --fabric "50 Mbit/s" --json out.json

Run under any mpiexec; across hosts the probe measures both fabrics, and
``--fabric`` only labels the rows (the link's rate, say). Each candidate
runs once untimed, then ``--repeats`` interleaved rounds (every candidate
once per round); a candidate's time is the median over rounds of the
slowest rank's. ``--markdown`` prints the rows as the table of
docs/ulysses.md.
"""

from __future__ import annotations

import functools
import time
from typing import Dict, List, Optional, Sequence, Tuple

import click
import torch
from mpi4py import MPI

import commlib
from commlib import hybrid, ring
from commlib.hybrid.planner import probe
from commlib.tools.bench.timing import interleaved_medians, json_option, write_json


def step(comm, shards: Sequence[torch.Tensor], dout: torch.Tensor, ulysses_size: int,
         method: str) -> None:
    """One forward and backward of the hybrid at this split."""
    options = dict(layout="zigzag", causal=True, method=method)
    out, lse = hybrid.hybrid_attention(*shards, comm, ulysses_size, return_lse=True, **options)
    hybrid.hybrid_attention_backward(dout, *shards, out, lse, comm, ulysses_size, **options)


def shape_row(world, comm, seq: int, heads: int, kv_heads: int, head_dim: int,
              repeats: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, h, head_dim, generator=generator)
            for h in (heads, kv_heads, kv_heads, heads)]
    q, k, v, dout = (ring.shard_sequence(x, comm, layout="zigzag") for x in full)
    picked = hybrid.plan(comm, seq, heads, kv_heads, head_dim, itemsize=4, causal=True,
                         backward=True, layout="zigzag")
    splits: List[Tuple[int, str]] = [(c.ulysses_size, c.method) for c in picked.candidates]
    calls = [functools.partial(step, comm, (q, k, v), dout, u, method) for u, method in splits]
    for call in calls:  # untimed: the first call of a split makes its sub-communicators
        call()
    times = dict(zip(splits, interleaved_medians(world, calls, repeats)))
    fastest = min(times, key=times.get)
    pick = (picked.ulysses_size, picked.method)
    return {"ranks": comm.size, "hosts": comm.topology.num_nodes, "seq": seq, "heads": heads,
            "kv_heads": kv_heads, "head_dim": head_dim,
            "measured_s": {_name(*s): t for s, t in times.items()},
            "predicted_s": {_name(c.ulysses_size, c.method): c.seconds
                            for c in picked.candidates},
            "pick": _name(*pick), "fastest": _name(*fastest),
            "pick_over_fastest": times[pick] / times[fastest], "explain": picked.explain()}


def _name(ulysses_size: int, method: str) -> str:
    return f"U{ulysses_size}" + ("/ag" if method == "allgather" else "")


def describe(row: dict, fabric: str) -> str:
    measured = ", ".join(f"{name} {t:.2f} s" for name, t in row["measured_s"].items())
    return (f"{fabric}: h {row['heads']}:{row['kv_heads']}, seq {row['seq']}: {measured}; "
            f"pick {row['pick']}, fastest {row['fastest']}, pick/fastest "
            f"{row['pick_over_fastest']:.3f} (target <= 1.10)")


def markdown(rows: List[dict], fabric: str) -> List[str]:
    lines = ["| fabric | heads:kv | seq | measured fwd+bwd (U = Ulysses degree, /ag: ring by "
             "all-gather) | predicted | pick | fastest | pick / fastest |",
             "|---|---|---:|---|---|---|---|---:|"]
    for row in rows:
        measured = ", ".join(f"{n} {t:.2f} s" for n, t in row["measured_s"].items())
        predicted = ", ".join(f"{n} {t:.2f} s" for n, t in row["predicted_s"].items())
        lines.append(f"| {fabric} | {row['heads']}:{row['kv_heads']} | {row['seq']} | "
                     f"{measured} | {predicted} | {row['pick']} | {row['fastest']} | "
                     f"{row['pick_over_fastest']:.3f} |")
    return lines


@click.command()
@click.option("--seq", "seqs", multiple=True, type=int, default=(8192,), show_default=True,
              help="Global sequence lengths of the grid (repeat the option).")
@click.option("--heads", default=8, show_default=True, help="Query heads.")
@click.option("--kv-heads", "kv_heads", multiple=True, type=int, default=(8, 1),
              show_default=True, help="Key/value heads of the grid (8: MHA, 1: GQA 8:1).")
@click.option("--head-dim", default=64, show_default=True)
@click.option("--repeats", default=2, show_default=True,
              help="Interleaved timed rounds (median).")
@click.option("--fabric", default="", help="A label for the rows: the link's rate, say.")
@click.option("--markdown", "as_markdown", is_flag=True, help="Print the docs table.")
@json_option
def main(seqs: Tuple[int, ...], heads: int, kv_heads: Tuple[int, ...], head_dim: int,
         repeats: int, fabric: str, as_markdown: bool, json_path: Optional[str]) -> None:
    """The planner's pick against the fastest split, over a grid; run under mpiexec."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = click.echo if comm.rank == 0 else (lambda *a, **k: None)
    label = fabric or f"{comm.topology.num_nodes} host(s)"
    start = time.perf_counter()
    fabric_probed = probe(comm)
    probe_s = time.perf_counter() - start
    say(f"bench_planner: {comm.size} ranks on {comm.topology.num_nodes} host(s); probe "
        f"{probe_s:.2f} s: {fabric_probed.describe()}")
    rows: List[Dict] = []
    for kv in kv_heads:
        for seq in seqs:
            rows.append(shape_row(world, comm, seq, heads, kv, head_dim, repeats))
            say(describe(rows[-1], label))
    if as_markdown:
        say("\n".join(markdown(rows, label)))
    write_json(json_path, {"fabric": label, "probe_s": probe_s,
                           "probed": fabric_probed.describe(), "rows": rows}, comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
