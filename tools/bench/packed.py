"""Context parallelism on real data, as ratios against baselines run in the
same launch (torch tensors: the fused CPU SDPA kernels; one thread a rank).

    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.packed balance packed allgather
    python -m commlib.tools.bench.packed sdpa --threads 2

- balance: causal work (visible query-key pairs) of the busiest rank over
  the mean, for documents of long-tailed lengths summing to ``--tokens``,
  plain zigzag against the per-document zigzag ("zigzag_docs"), P = 2..8
  (computed, not timed).
- packed: forward+backward over the same documents, causal: the packed ring
  with per-document balance against the plain zigzag ring on the packed
  sequence, against the same documents each padded to the longest and run
  unpacked as a batch (a commlib ring).
- sdpa (alone, without mpiexec, ``--threads`` = the ranks' cores): torch
  SDPA document by document in one process, the same documents: what the
  packed ring is up against.
- allgather: ``method="allgather"`` against the ring at GQA 8:1 and 1:1,
  causal zigzag, forward+backward; and which one ``hybrid.plan`` picks.
"""

from __future__ import annotations

from typing import List, Optional

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib import hybrid, ring
from commlib.sequence.documents import needed_length, packing_for
from commlib.sequence.visibility import blocks, bounds
from commlib.tools.bench.timing import best_local, best_slowest, json_option, write_json


def long_tailed_documents(tokens: int, longest: int, seed: int = 0) -> np.ndarray:
    """cu_seqlens of documents with Pareto lengths (many short, a few long,
    capped at ``longest``) summing to exactly ``tokens``."""
    rng = np.random.default_rng(seed)
    lengths: List[int] = []
    while sum(lengths) < tokens:
        lengths.append(int(min(longest, 64 + rng.pareto(1.1) * 600)))
    lengths[-1] -= sum(lengths) - tokens
    lengths = [n for n in lengths if n > 0]
    return np.cumsum([0] + lengths)


def causal_work(offsets, layout: str, size: int) -> List[int]:
    """Visible causal pairs each rank computes over a whole ring pass."""
    packing = packing_for(offsets, layout, size, needed_length(tuple(offsets), layout, size))
    lo, hi = bounds(True, None)
    return [sum(b.pairs for source in range(size)
                for b in blocks(packing.spans(rank), packing.spans(source), lo, hi))
            for rank in range(size)]


def balance(world, comm, offsets, args) -> List[dict]:
    rows = []
    for size in (2, 4, 8):
        row = {"test": "balance", "ranks": size, "documents": len(offsets) - 1}
        for layout in ("zigzag", "zigzag_docs"):
            work = causal_work(offsets, layout, size)
            row[layout] = max(work) / float(np.mean(work))
        rows.append(row)
    return rows


def _step(comm, full, layout: str, options: dict):
    """A forward+backward of the torch binding's ring over the shards of
    the global ``full`` (q, k, v)."""
    from commlib.bindings import torch as ct

    shards = [ring.shard_sequence(x, comm, layout=layout, cu_seqlens=options.get("cu_seqlens"))
              .requires_grad_() for x in full]

    def run():
        out = ct.ring_attention(*shards, comm, causal=True, layout=layout, **options)
        out.sum().backward()
    return run


def _qkv(batch: int, length: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, h, dim, generator=generator)
            for h in (heads, kv_heads, kv_heads)]


def packed(world, comm, offsets, args) -> List[dict]:
    heads, dim, size = args["heads"], args["head_dim"], comm.size
    full = _qkv(1, int(offsets[-1]), heads, heads, dim)
    lengths = np.diff(offsets)
    longest = -(-int(lengths.max()) // (2 * size)) * 2 * size
    padded = _qkv(len(lengths), longest, heads, heads, dim)
    cu = [int(o) for o in offsets]
    runs = {"zigzag_docs": _step(comm, full, "zigzag_docs", {"cu_seqlens": cu}),
            "zigzag": _step(comm, full, "zigzag", {"cu_seqlens": cu}),
            "padded": _step(comm, padded, "zigzag", {})}
    times = {name: best_slowest(world, run, args["repeats"]) for name, run in runs.items()}
    row = {"test": "packed", "ranks": size, "tokens": int(offsets[-1]),
           "documents": len(lengths), "longest": int(lengths.max()), "heads": heads,
           "dim": dim, **{f"{name}_s": t for name, t in times.items()},
           "padded_over_packed": times["padded"] / times["zigzag_docs"],
           "zigzag_over_docs": times["zigzag"] / times["zigzag_docs"]}
    return [row]


def sdpa(world, comm, offsets, args) -> List[dict]:
    """The one-process alternative: run alone (no mpiexec), all cores."""
    if comm.size != 1:
        raise click.UsageError("sdpa is the one-process baseline: run it without mpiexec")
    torch.set_num_threads(args["threads"])
    full = _qkv(1, int(offsets[-1]), args["heads"], args["heads"], args["head_dim"])
    seconds = best_local(lambda: _sdpa_documents(full, offsets), args["repeats"])
    return [{"test": "sdpa", "threads": args["threads"], "tokens": int(offsets[-1]),
             "documents": len(offsets) - 1, "seconds": seconds}]


def _sdpa_documents(full, offsets) -> None:
    q, k, v = (x.detach().transpose(1, 2).requires_grad_() for x in full)
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
        for a, b in zip(offsets[:-1], offsets[1:])]
    torch.cat(outs, dim=2).sum().backward()


def allgather(world, comm, offsets, args) -> List[dict]:
    rows = []
    heads, dim, seq = args["heads"], args["head_dim"], args["seq"]
    for kv_heads in (heads // 8, heads):
        full = _qkv(1, seq, heads, kv_heads, dim)
        times = {method: best_slowest(world, _step(comm, full, "zigzag", {"method": method}),
                                      args["repeats"]) for method in ("ring", "allgather")}
        plan = hybrid.plan(comm, seq, heads, kv_heads, dim, itemsize=4, causal=True,
                           layout="zigzag")
        as_ring = min((c for c in plan.candidates if c.ulysses_size == 1),
                      key=lambda c: c.seconds)  # its choice for a ring of every rank
        rows.append({"test": "allgather", "ranks": comm.size, "seq": seq, "heads": heads,
                     "kv_heads": kv_heads, "ring_s": times["ring"],
                     "allgather_s": times["allgather"],
                     "allgather_over_ring": times["allgather"] / times["ring"],
                     "planner_method": as_ring.method,
                     "planner_picked_faster": as_ring.method == min(times, key=times.get),
                     "planner_overall": f"Ulysses {plan.ulysses_size} x Ring {plan.ring_size} "
                                        f"({plan.method})"})
    return rows


TESTS = {"balance": balance, "packed": packed, "allgather": allgather, "sdpa": sdpa}


def describe(row: dict) -> str:
    if row["test"] == "balance":
        return (f"balance P={row['ranks']}, {row['documents']} documents: busiest/mean causal "
                f"work zigzag {row['zigzag']:.3f}, zigzag_docs {row['zigzag_docs']:.3f}")
    if row["test"] == "sdpa":
        return (f"torch SDPA document by document, one process, {row['threads']} threads: "
                f"{row['tokens']} tokens, {row['documents']} documents, fwd+bwd "
                f"{row['seconds']:.2f} s")
    if row["test"] == "packed":
        return (f"packed {row['tokens']} tokens, {row['documents']} documents (longest "
                f"{row['longest']}), fwd+bwd at {row['ranks']} ranks: zigzag_docs "
                f"{row['zigzag_docs_s']:.2f} s; plain zigzag {row['zigzag_s']:.2f} s "
                f"({row['zigzag_over_docs']:.2f}x); padded to the longest, unpacked "
                f"{row['padded_s']:.2f} s ({row['padded_over_packed']:.2f}x)")
    return (f"allgather seq {row['seq']}, heads {row['heads']}:{row['kv_heads']}: ring "
            f"{row['ring_s']:.2f} s, allgather {row['allgather_s']:.2f} s "
            f"({row['allgather_over_ring']:.2f}x); for a ring of every rank the planner picks "
            f"{row['planner_method']} "
            f"({'the faster' if row['planner_picked_faster'] else 'NOT the faster'}); "
            f"overall it picks {row['planner_overall']}")


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(sorted(TESTS)))
@click.option("--tokens", default=65536, show_default=True, help="Packed tokens (balance, packed).")
@click.option("--longest", default=16384, show_default=True, help="Longest document.")
@click.option("--seq", default=16384, show_default=True, help="Sequence length (allgather).")
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True, help="Torch threads (sdpa).")
@click.option("--repeats", default=2, show_default=True, help="Best of this many runs.")
@json_option
def main(tests, tokens: int, longest: int, seq: int, heads: int, head_dim: int, threads: int,
         repeats: int, json_path: Optional[str]) -> None:
    """Packed documents, per-document balance and the all-gather mode."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = commlib.init()
    offsets = long_tailed_documents(tokens, longest)
    args = {"heads": heads, "head_dim": head_dim, "seq": seq, "repeats": repeats,
            "threads": threads}
    rows = [row for test in (tests or ("balance", "packed", "allgather"))
            for row in TESTS[test](world, comm, offsets, args)]
    if comm.rank == 0:
        for row in rows:
            click.echo(describe(row))
    write_json(json_path, rows, comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
