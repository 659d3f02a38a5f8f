"""Any mask across ranks: the balanced solver's spread of work, the K/V
bytes the sparse exchange moves, the solver's speed, and a masked
forward+backward on P ranks against torch SDPA with the same dense mask in
one process on the same cores, in one launch.

    mpiexec -n 2 python -m commlib.tools.bench.masks

Computed, not timed (rank 0): for each mask, the busiest rank's visible
query-key pairs over the mean under ``balanced``, ``zigzag`` and
``contiguous`` at P = 2, 4, 8; the K/V rows the busiest rank receives from
the sparse exchange against the ring's (P - 1) shards; the solver's time
for ``--solver-tokens`` tokens in 512-token chunks (best of 3).

Timed: first rank 0 alone (the others wait without spinning) runs torch
SDPA with the dense boolean mask and ``--threads`` threads (all the cores)
(and, for plain causality, SDPA's fused ``is_causal=True`` kernel, the
real alternative there); then every rank, one thread each, runs the torch
binding's ``ring_attention`` over ``layout="balanced"`` shards with ``mask=`` and
``method="auto"`` (sparse where it moves less, else the ring): the ring,
the all-gather, the sparse exchange and Ulysses each timed, forward and
backward, the slowest rank's time, best of ``--repeats``; and which of them
``hybrid.plan(..., mask=mask)`` picks, against the fastest measured.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional

import click
import torch
from mpi4py import MPI

import commlib
from commlib import hybrid, ring
from commlib.bindings import torch as ct
from commlib.ring.sparse import SPARSE_SHARE, routes
from commlib.sequence import balanced
from commlib.sequence.common_masks import block_diagonal, multimodal, prefix_lm, shared_prefix
from commlib.sequence.masks import Mask, from_cu_seqlens
from commlib.tools.bench.timing import best_slowest, first_rank_alone, json_option, write_json


def masks(length: int) -> Dict[str, Mask]:
    """The masks the issue names, at ``length`` tokens."""
    n = length
    return {
        "causal": from_cu_seqlens([0, n], causal=True),
        "prefix-lm (1/4 prefix)": prefix_lm(n, n // 4),
        "shared prefix + 4 branches": shared_prefix(n, n // 4, 4),
        "multimodal (2 images)": multimodal(n, [(n // 8, n // 4), (n // 2, n // 2 + n // 6)]),
        "block-diagonal, 8 docs": block_diagonal(n, 8, causal=False),
        "causal docs, window n/16": from_cu_seqlens([0, n // 4, n // 2, n], causal=True,
                                                   window=(n // 16, 0)),
    }


def spread(mask: Mask) -> List[dict]:
    """Busiest/mean visible pairs per layout, and the sparse exchange's
    busiest received rows against the ring's, at P = 2, 4, 8."""
    rows = []
    for size in (2, 4, 8):
        row: dict = {"ranks": size}
        for layout in ("balanced", "zigzag", "contiguous"):
            work = balanced.loads(mask, balanced.placement_for(layout, size, None, mask=mask))
            row[layout] = float(work.max() / work.mean())
        plan = routes(mask, balanced.solve(mask, size))
        row["sparse_share"] = plan.busiest_share()
        rows.append(row)
    return rows


def solver_seconds(tokens: int) -> float:
    """The balanced solver from scratch (no cache) for a multimodal mask of
    ``tokens`` in 512-token chunks over 8 ranks, best of 3."""
    mask = multimodal(tokens, [(tokens // 8, tokens // 4), (tokens // 2, tokens // 2 + 4096)])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        balanced.solve.__wrapped__(mask, 8, 512)
        best = min(best, time.perf_counter() - start)
    return best


def _qkv(length: int, heads: int, kv_heads: int, dim: int):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, length, h, dim, generator=generator)
            for h in (heads, kv_heads, kv_heads)]


def _sdpa_step(full, mask: Optional[Mask]) -> Callable[[], None]:
    """SDPA forward+backward over the whole sequence with the dense mask
    (None: ``is_causal=True``, the fused causal kernel that skips hidden
    blocks)."""
    options = {"is_causal": True} if mask is None else \
        {"attn_mask": torch.as_tensor(mask.dense())}
    groups = full[0].shape[2] // full[1].shape[2]

    def run():
        q, k, v = (x.transpose(1, 2).detach().requires_grad_() for x in full)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **options)
        out.sum().backward()
    return run


def _alone(full, mask: Optional[Mask], args: dict) -> float:
    """SDPA's best time in this process with every thread."""
    torch.set_num_threads(args["threads"])
    step = _sdpa_step(full, mask)
    step()
    seconds = best_slowest(MPI.COMM_SELF, step, args["repeats"])
    torch.set_num_threads(1)
    return seconds


def _baselines(full, mask: Mask, causal: bool, args: dict) -> dict:
    """SDPA with the dense mask; for plain causality also its fused causal
    kernel."""
    return {"dense": _alone(full, mask, args),
            "causal": _alone(full, None, args) if causal else None}


def _step(comm, full, mask: Mask, algorithm: str) -> Callable[[], None]:
    """The torch binding's forward+backward over balanced shards: Ulysses,
    or the ring run as ``algorithm`` (a ring method)."""
    shards = [ring.shard_sequence(x, comm, layout="balanced", mask=mask) for x in full]

    def run():
        q, k, v = (x.detach().requires_grad_() for x in shards)
        if algorithm == "ulysses":
            out = ct.ulysses_attention(q, k, v, comm, layout="balanced", causal=False,
                                       mask=mask)
        else:
            out = ct.ring_attention(q, k, v, comm, layout="balanced", causal=False,
                                    mask=mask, method=algorithm)
        out.sum().backward()
    return run


def _picked(plan, size: int) -> str:
    """The planner's pick as one of the timed algorithms (a split of the
    world between them is not timed)."""
    if plan.ulysses_size == size:
        return "ulysses"
    return plan.method if plan.ring_size == size else \
        f"Ulysses {plan.ulysses_size} x Ring {plan.ring_size}"


ALGORITHMS = ("ring", "allgather", "sparse", "ulysses")


def timed(comm, named: Dict[str, Mask], args: dict) -> List[dict]:
    world, rows = comm.mpi_comm, []
    for name, mask in named.items():
        full = _qkv(mask.length, args["heads"], args["kv_heads"], args["head_dim"])
        alone = first_rank_alone(world, functools.partial(
            _baselines, full, mask, name == "causal", args))
        times = {}
        for algorithm in ALGORITHMS:
            step = _step(comm, full, mask, algorithm)
            step()
            times[algorithm] = best_slowest(world, step, args["repeats"])
        share = routes(mask, balanced.solve(mask, comm.size)).busiest_share()
        auto = "sparse" if share <= SPARSE_SHARE else "ring"   # what method="auto" runs
        plan = hybrid.plan(comm, mask.length, args["heads"], args["kv_heads"], args["head_dim"],
                           itemsize=4, causal=False, layout="balanced", mask=mask,
                           backward=True)
        rows.append({"mask": name, "ranks": comm.size, "sdpa_s": alone["dense"],
                     "sdpa_is_causal_s": alone["causal"], "auto_s": times[auto],
                     **{f"{a}_s": t for a, t in times.items()},
                     "auto_over_sdpa": times[auto] / alone["dense"], "sparse_share": share,
                     "auto_method": auto, "planner_pick": _picked(plan, comm.size),
                     "fastest": min(times, key=times.get),
                     "density": float(mask.pairs_in((0, mask.length))) / mask.length ** 2})
    return rows


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Tokens of the timed masks.")
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--threads", default=2, show_default=True,
              help="torch threads of the one-process SDPA (the launch's cores).")
@click.option("--repeats", default=2, show_default=True)
@click.option("--solver-tokens", default=2 ** 20, show_default=True)
@json_option
def main(seq: int, heads: int, kv_heads: int, head_dim: int, threads: int, repeats: int,
         solver_tokens: int, json_path: Optional[str]) -> None:
    """Balance, bytes, solver speed and masked attention against SDPA."""
    torch.set_num_threads(1)
    comm = commlib.init()
    named = masks(seq)
    args = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "threads": threads,
            "repeats": repeats}
    computed = first_rank_alone(comm.mpi_comm, lambda: {
        "spread": {name: spread(mask) for name, mask in named.items()},
        "solver_s": solver_seconds(solver_tokens)})
    rows = timed(comm, named, args)
    if comm.rank:
        return
    click.echo(f"# balance: busiest rank's visible pairs / mean; sparse: the busiest rank's "
               f"received K/V rows / the ring's (P-1) shards ({seq} tokens)")
    for name, table in computed["spread"].items():
        for row in table:
            click.echo(f"{name:28s} P={row['ranks']}: balanced {row['balanced']:.3f}, zigzag "
                       f"{row['zigzag']:.3f}, contiguous {row['contiguous']:.3f}; sparse "
                       f"{row['sparse_share']:.3f} of the ring's bytes")
    click.echo(f"# solver: {solver_tokens} tokens, 512-token chunks, 8 ranks: "
               f"{computed['solver_s'] * 1e3:.1f} ms")
    click.echo(f"# fwd+bwd, {comm.size} ranks x 1 thread (balanced layout) vs "
               f"torch SDPA + dense mask, 1 process x {threads} threads; {seq} tokens, {heads} "
               f"heads / {kv_heads} kv, head_dim {head_dim}, float32")
    for row in rows:
        click.echo(f"{row['mask']:28s} density {row['density']:.3f}: SDPA {row['sdpa_s']:.2f} s, "
                   f"commlib {row['auto_method']} {row['auto_s']:.2f} s "
                   f"({row['auto_over_sdpa']:.2f}x), ring {row['ring_s']:.2f} s "
                   f"({row['ring_s'] / row['sdpa_s']:.2f}x)")
        pick = row["planner_pick"]
        measured = f"{row[pick + '_s'] / row[row['fastest'] + '_s']:.2f}x the fastest" \
            if pick in ALGORITHMS else "not timed"
        click.echo(f"{'':28s} " + ", ".join(f"{a} {row[a + '_s']:.2f} s" for a in ALGORITHMS)
                   + f"; the planner picks {pick} ({measured})")
        if row["sdpa_is_causal_s"]:
            click.echo(f"{'':28s} against SDPA is_causal=True {row['sdpa_is_causal_s']:.2f} s: "
                       f"commlib {row['auto_s'] / row['sdpa_is_causal_s']:.2f}x")
    write_json(json_path, {**computed, "timed": rows}, indent=2)


if __name__ == "__main__":
    main()
