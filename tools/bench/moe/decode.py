"""``moe decode``: a decode step's dispatch + combine, counted and fixed,
torch and NumPy, against the bare exchanges of its bytes and the plain
slots a user writes by hand, with the torch pairs' aten ops."""

from __future__ import annotations

import functools
from typing import Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.moe.baselines import PlainSlots, there_and_back
from commlib.tools.bench.moe.workload import dispatch_combine, torch_routing
from commlib.tools.bench.ops import warm_torch_ops
from commlib.tools.bench.timing import interleaved, json_option, repeated, write_json


@click.command()
@click.option("--tokens", default="1,8,64,512", show_default=True,
              help="Tokens per rank, comma-separated.")
@click.option("--hidden", default=7168, show_default=True)
@click.option("--experts", "num_experts", default=16, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--repeat", default=20, show_default=True, help="Pairs per timed unit.")
@click.option("--iters", default=9, show_default=True)
@json_option
def decode(tokens: str, hidden: int, num_experts: int, topk: int, repeat: int, iters: int,
           json_path: Optional[str]) -> None:
    """A decode step's dispatch + combine of bfloat16 rows, counted and under
    a fixed capacity, through the torch Dispatcher and the core on NumPy
    arrays, against the bare mpi4py exchange of the same bytes there and
    back (a count exchange and ``Alltoallv`` each way, nothing else); the
    fixed capacity (the low-latency slot layout) and the plain pair a user
    writes by hand (``PlainSlots``) against the two bare ``Alltoall`` of
    that layout's bytes, all interleaved in one process (issues 37, 46).
    Each torch pair's framework operations are counted too
    (``tools/bench/ops.py``)."""
    import ml_dtypes
    import torch

    from commlib.bindings.torch import Dispatcher as TorchDispatcher
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_moe decode: {comm.size} ranks; {hidden} bfloat16 channels, {num_experts} "
        f"experts, top-{topk}; identity experts; microseconds per pair, slowest rank; "
        f"torch pairs' top-level aten ops")
    rows = []
    for count in (int(t) for t in tokens.split(",")):
        x, experts, weights = torch_routing(comm, count, hidden, num_experts, topk, seed=1)
        nx = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        ne, nw = experts.numpy(), weights.numpy()
        made = {"torch": lambda **kw: TorchDispatcher(comm, num_experts, **kw),
                "NumPy": lambda **kw: moe.Dispatcher(comm, num_experts, **kw)}
        args = {"torch": (x, experts, weights), "NumPy": (nx, ne, nw)}
        _, handle = moe.Dispatcher(comm, num_experts).dispatch(nx, ne, nw)
        there = handle.route.send_counts.astype(np.int64)  # flat: one hop
        row_bytes = hidden * 2 + 8 * topk
        bare = there_and_back(raw, np.zeros((int(there.sum()), row_bytes), np.uint8), there,
                              back_bytes=hidden * 2)
        plain = PlainSlots(raw, num_experts, count, hidden)
        contenders = {"mpi4py bare exchange": repeated(bare, repeat),
                      "bare Alltoall (slots)": repeated(plain.bare(), repeat),
                      "torch plain slots": repeated(functools.partial(plain, x, experts, weights),
                                                 repeat)}
        # the fixed capacity is the slot layout (a row per token and expert): its bytes
        against = {name: "bare Alltoall (slots)"
                   for name in ("torch plain slots", "torch fixed", "NumPy fixed")}
        ops = {"torch plain slots": warm_torch_ops(functools.partial(plain, x, experts, weights))}
        fixed_ones = []
        for name in ("torch", "NumPy"):
            for mode, kw in (("counted", {}), ("fixed", {"max_tokens_per_rank": count})):
                d = made[name](**kw)
                if kw:
                    fixed_ones.append(d)
                pair = dispatch_combine(d, *args[name])
                contenders[f"{name} {mode}"] = repeated(pair, repeat)
                if name == "torch":
                    ops[f"{name} {mode}"] = warm_torch_ops(pair)
        times = {name: float(np.median(t)) / repeat * 1e6
                 for name, t in interleaved(world, contenders, iters).items()}
        say(f"-- {count} tokens per rank")
        for name, micros in times.items():
            baseline = against.get(name, "mpi4py bare exchange")
            ratio = micros / times[baseline]
            rows.append({"tokens": count, "contender": name, "us_per_pair": micros,
                         "baseline": baseline, "ratio_to_bare": ratio,
                         "aten_ops": ops.get(name)})
            counted = f", {ops[name]} aten ops" if name in ops else ""
            say(f"{name:>22}: {micros:9.1f} us per pair ({ratio:.2f}x {baseline}{counted})",
                flush=True)
        for d in fixed_ones:
            d.collect_stats()
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()
