"""Ulysses and the planner on this machine, as ratios against baselines run
in the same launch.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.ulysses relayout fused
    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m commlib.tools.bench.ulysses relayout fused planner

- relayout: ``seq_to_head`` of [1, 8192, 16, 128] float32 against the same
  relayout written by hand: NumPy pack, mpi4py ``Alltoall``, NumPy unpack.
- fused: q, k and v relaid in one all-to-all (``seq_to_head_many``) against
  three ``seq_to_head`` calls, on a short (latency-bound) sequence.
- planner: for three shapes (few heads, many heads, GQA) every allowed
  Ulysses x Ring split of ``hybrid_attention`` is timed, and the planner's
  pick is compared with the fastest.
- overlap: a Flux-like block's Q/K/V projection and Ulysses attention (torch,
  bfloat16, inference), serial (project, then ``ulysses_attention``) against
  ``ulysses_attention_overlapped`` at several group counts, and the same
  compute with no communication (the projection and one rank's heads'
  attention): exposed communication = total - compute.
- wire: the exchange alone (q, k, v seq->head, out head->seq) in bfloat16
  against ``wire="float8"``, and the attention output's error of the FP8
  exchange against the bfloat16 one, on random activations (plain, outlier
  heads, outlier tokens) and on Q/K/V captured from a tiny diffusers Flux
  model (random weights, its norms and rotary embedding) where diffusers is
  installed.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import hybrid, ulysses
from commlib.tools.bench.timing import interleaved_medians, json_option, write_json
from commlib.ulysses.relayout import divisors


def by_hand(world: MPI.Comm, x: np.ndarray) -> np.ndarray:
    """seq_to_head as a user writes it without commlib."""
    size = world.Get_size()
    b, sl, h, d = x.shape
    send = np.ascontiguousarray(x.reshape(b, sl, size, h // size, d).transpose(2, 0, 1, 3, 4))
    received = np.empty_like(send)
    world.Alltoall(send, received)
    return np.ascontiguousarray(received.transpose(1, 0, 2, 3, 4)).reshape(
        b, size * sl, h // size, d)


def relayout(comm, world, repeats: int) -> List[dict]:
    shape = (1, 8192 // comm.size, 16, 128)
    x = np.random.default_rng(comm.rank).standard_normal(shape, dtype=np.float32)
    raw = world.Dup()
    if not np.array_equal(ulysses.seq_to_head(x, comm), by_hand(raw, x)):
        raise AssertionError("seq_to_head differs from the hand-written relayout")
    t_lib, t_hand = interleaved_medians(world, [lambda: ulysses.seq_to_head(x, comm),
                                                lambda: by_hand(raw, x)], repeats)
    raw.Free()
    return [{"test": "relayout", "ranks": comm.size, "shape": [1, 8192, 16, 128],
             "commlib_s": t_lib, "by_hand_s": t_hand, "ratio": t_lib / t_hand}]


def fused(comm, world, repeats: int) -> List[dict]:
    rows = []
    for seq in (16, 64, 1024):
        rng = np.random.default_rng(comm.rank)
        q = rng.standard_normal((1, seq // comm.size, 16, 64), dtype=np.float32)
        k = rng.standard_normal((1, seq // comm.size, 4, 64), dtype=np.float32) \
            if comm.size <= 4 else q
        v = k.copy()
        t_three, t_one = interleaved_medians(world, [  # sub-millisecond calls: many rounds
            lambda q=q, k=k, v=v: [ulysses.seq_to_head(t, comm) for t in (q, k, v)],
            functools.partial(ulysses.seq_to_head_many, [q, k, v], comm)], 40 * repeats)
        rows.append({"test": "fused", "ranks": comm.size, "seq": seq, "three_calls_s": t_three,
                     "fused_s": t_one, "speedup": t_three / t_one})
    return rows


SHAPES = {"few heads": (4, 4), "many heads": (16, 16), "GQA": (16, 2)}


def planner(comm, world, repeats: int, seq: int = 4096, head_dim: int = 64) -> List[dict]:
    rows = []
    for name, (heads, kv_heads) in SHAPES.items():
        rng = np.random.default_rng(comm.rank)
        q = rng.standard_normal((1, seq // comm.size, heads, head_dim), dtype=np.float32)
        k = rng.standard_normal((1, seq // comm.size, kv_heads, head_dim), dtype=np.float32)
        v = k.copy()
        pick = hybrid.plan(comm, seq, heads, kv_heads, head_dim, itemsize=4, causal=False,
                           layout="contiguous", methods=("ring",))
        allowed = [c.ulysses_size for c in pick.candidates]
        times = dict(zip(allowed, interleaved_medians(world, [
            functools.partial(hybrid.hybrid_attention, q, k, v, comm, u, layout="contiguous",
                              causal=False)
            for u in allowed],
            repeats)))
        fastest = min(times, key=times.get)
        rows.append({"test": "planner", "shape": name, "ranks": comm.size, "seq": seq,
                     "heads": heads, "kv_heads": kv_heads,
                     "seconds_by_ulysses_size": times, "pick": pick.ulysses_size,
                     "predicted": {c.ulysses_size: c.seconds for c in pick.candidates},
                     "fastest": fastest,
                     "pick_over_fastest": times[pick.ulysses_size] / times[fastest],
                     "explain": pick.explain()})
    return rows


def describe(row: dict) -> str:
    if row["test"] == "overlap":
        groups = ", ".join(f"{g} groups {t * 1e3:.0f} ms (exposed "
                           f"{row['exposed_overlapped_s'][g] * 1e3:.0f})"
                           for g, t in row["overlapped_s"].items())
        return (f"overlap hidden {row['hidden']}, {row['heads']}x{row['head_dim']}, "
                f"{row['tokens']} tokens bf16: serial {row['serial_s'] * 1e3:.0f} ms (exposed "
                f"{row['exposed_serial_s'] * 1e3:.0f}), {groups}; compute alone "
                f"{row['compute_s'] * 1e3:.0f} ms")
    if row["test"] == "wire-error":
        return (f"FP8 wire vs bfloat16, {row['activations']} {row['shape']}: attention out, "
                f"worst head: max |error| / max |out| {row['max_relative']:.4f}, mean |error| "
                f"/ mean |out| {row['mean_relative']:.4f}")
    if row["test"] == "wire-time":
        return (f"exchange (q, k, v in, out back) {row['heads']}x{row['head_dim']}, "
                f"{row['tokens']} tokens: bfloat16 {row['bfloat16_s'] * 1e3:.1f} ms, float8 "
                f"{row['float8_s'] * 1e3:.1f} ms")
    if row["test"] == "relayout":
        return (f"relayout [1, 8192, 16, 128] f32: commlib {row['commlib_s'] * 1e3:.2f} ms, "
                f"by hand {row['by_hand_s'] * 1e3:.2f} ms, ratio {row['ratio']:.3f} "
                f"(target <= 1.10)")
    if row["test"] == "fused":
        return (f"fused q/k/v seq {row['seq']}: three calls {row['three_calls_s'] * 1e3:.2f} ms, "
                f"one {row['fused_s'] * 1e3:.2f} ms, speedup {row['speedup']:.2f} "
                f"(target >= 1.2 when latency-bound)")
    times = ", ".join(f"U{u}xR{comm_size_over(row, u)} {t * 1e3:.0f} ms"
                      for u, t in row["seconds_by_ulysses_size"].items())
    return (f"planner {row['shape']} (h {row['heads']}, kv {row['kv_heads']}, seq {row['seq']}): "
            f"{times}; pick U{row['pick']}, fastest U{row['fastest']}, pick/fastest "
            f"{row['pick_over_fastest']:.3f} (target <= 1.10)")


def comm_size_over(row: dict, u: int) -> int:
    return row["ranks"] // u


# a Flux block scaled to this CPU: hidden 1536 = 12 heads of 128, 2048 tokens
# (Flux: 3072 = 24 x 128, 4096 image tokens and more)
FLUX_LIKE = dict(hidden=1536, heads=12, head_dim=128, tokens=2048)


def _flux_like_block(comm, hidden: int, heads: int, head_dim: int, tokens: int):
    """This rank's hidden states and the block's fused Q/K/V weight, bfloat16."""
    import torch
    generator = torch.Generator().manual_seed(0)  # the same weights everywhere
    weight = (torch.randn(3 * heads * head_dim, hidden, generator=generator)
              / hidden ** 0.5).to(torch.bfloat16)
    x = torch.randn(1, tokens // comm.size, hidden,
                    generator=torch.Generator().manual_seed(1 + comm.rank)).to(torch.bfloat16)
    return x, weight.view(3, heads, head_dim, hidden)


def overlap(comm, world, repeats: int) -> List[dict]:
    import torch

    from commlib.bindings.torch import ulysses_attention_overlapped
    shape = FLUX_LIKE
    heads, head_dim = shape["heads"], shape["head_dim"]
    x, weight = _flux_like_block(comm, **shape)
    options = dict(layout="contiguous", causal=False)

    def project(h: slice, kv: slice):
        q, k, v = (torch.einsum("bsc,hdc->bshd", x, weight[i, span])
                   for i, span in enumerate((h, kv, kv)))
        return q, k, v

    def serial():
        return ulysses.ulysses_attention(*project(slice(0, heads), slice(0, heads)), comm,
                                         **options)

    mine = heads // comm.size  # the compute alone: the projection, and this rank's heads
    gathered = torch.randn(1, mine, shape["tokens"], head_dim).to(torch.bfloat16)

    def compute():
        project(slice(0, heads), slice(0, heads))
        torch.nn.functional.scaled_dot_product_attention(gathered, gathered, gathered)

    groups = [g for g in (2, 3, 4, 6) if heads % g == 0 and heads // g >= comm.size]
    contenders = [serial, compute] + [
        functools.partial(ulysses_attention_overlapped, project, comm, num_heads=heads,
                          groups=g, **options) for g in groups]
    with torch.inference_mode():
        want = serial()
        for g in groups:
            got = ulysses_attention_overlapped(project, comm, num_heads=heads, groups=g,
                                               **options)
            if not torch.equal(got, want):
                raise AssertionError(f"the overlap at {g} groups differs from ulysses_attention")
        times = interleaved_medians(world, contenders, repeats)
    t_serial, t_compute, *t_groups = times
    return [{"test": "overlap", "ranks": comm.size, **shape, "dtype": "bfloat16",
             "serial_s": t_serial, "compute_s": t_compute,
             "overlapped_s": dict(zip(groups, t_groups)),
             "exposed_serial_s": t_serial - t_compute,
             "exposed_overlapped_s": {g: t - t_compute for g, t in zip(groups, t_groups)}}]


ACTIVATIONS = ("normal", "outlier v heads", "outlier v tokens", "sharp heads")


def _activations(kind: str, comm, heads: int, head_dim: int, tokens: int):
    """Global bfloat16 q, k, v [1, tokens, heads, head_dim] ~ N(0, 1), and
    for ``kind``: v of two heads 20x larger ("outlier v heads"), v of 1% of
    the tokens 20x larger ("outlier v tokens"), q and k of two heads 4x
    larger, their logits 16x ("sharp heads")."""
    import torch
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, tokens, heads, head_dim, generator=generator) for _ in range(3))
    if kind == "outlier v heads":
        v[:, :, :2] *= 20
    if kind == "outlier v tokens":
        v[:, torch.randperm(tokens, generator=generator)[:max(1, tokens // 100)]] *= 20
    if kind == "sharp heads":
        q[:, :, :2] *= 4
        k[:, :, :2] *= 4
    return [t.to(torch.bfloat16) for t in (q, k, v)]


def _flux_activations(comm, tokens: int):
    """q, k, v of every attention of a tiny diffusers Flux model (random
    weights; its RMS norms and rotary embedding), as the processor hands
    them to the attention, [1, tokens, heads, head_dim] bfloat16 each."""
    import torch
    from diffusers import FluxTransformer2DModel
    from diffusers.models.transformers import transformer_flux

    torch.manual_seed(3)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1,
                                   num_single_layers=1, attention_head_dim=64,
                                   num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(8, 28, 28))
    captured = []
    attend = transformer_flux.dispatch_attention_fn

    def capture(q, k, v, *args, **kwargs):
        captured.append([t.detach().to(torch.bfloat16) for t in (q, k, v)])
        return attend(q, k, v, *args, **kwargs)
    text = 64
    side = int((tokens - text) ** 0.5)
    image = torch.randn(1, side * side, 16)
    axes = (torch.zeros(1), torch.arange(side, dtype=torch.float32),
            torch.arange(side, dtype=torch.float32))
    ids = torch.stack(torch.meshgrid(*axes,
                                     indexing="ij"), -1).reshape(-1, 3)
    transformer_flux.dispatch_attention_fn = capture
    try:
        with torch.inference_mode():
            model(hidden_states=image, encoder_hidden_states=torch.randn(1, text, 32),
                  pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                  img_ids=ids, txt_ids=torch.zeros(text, 3), guidance=None)
    finally:
        transformer_flux.dispatch_attention_fn = attend
    length = (text + side * side) // comm.size * comm.size  # shardable
    return [[t[:, :length] for t in qkv] for qkv in captured]


def wire(comm, world, repeats: int) -> List[dict]:
    import torch
    shape = FLUX_LIKE
    heads, head_dim, tokens = shape["heads"], shape["head_dim"], shape["tokens"]
    options = dict(layout="contiguous", causal=False)
    rows = []
    sets = {kind: [_activations(kind, comm, heads, head_dim, tokens)] for kind in ACTIVATIONS}
    try:
        sets["diffusers Flux (tiny, random weights)"] = _flux_activations(comm, 1088)
    except ImportError:
        pass
    with torch.inference_mode():
        for kind, calls in sets.items():
            max_error = mean_error = 0.0
            for full in calls:
                q, k, v = (ulysses_shard(t, comm) for t in full)
                exact = ulysses.ulysses_attention(q, k, v, comm, **options).float()
                fp8 = ulysses.ulysses_attention(q, k, v, comm, wire="float8", **options).float()
                error, size = (fp8 - exact).abs(), exact.abs()  # per head: [b, s, h, d]
                max_error = max(max_error, world.allreduce(float(
                    (error.amax(dim=(0, 1, 3)) / size.amax(dim=(0, 1, 3))).max()), op=MPI.MAX))
                mean_error = max(mean_error, world.allreduce(float(
                    (error.mean(dim=(0, 1, 3)) / size.mean(dim=(0, 1, 3))).max()), op=MPI.MAX))
            rows.append({"test": "wire-error", "ranks": comm.size, "activations": kind,
                         "shape": list(calls[0][0].shape), "max_relative": max_error,
                         "mean_relative": mean_error})
        q, k, v = (ulysses_shard(t, comm) for t in sets["normal"][0])
        out = ulysses.ulysses_attention(q, k, v, comm, **options)

        def exchange(wire):
            ulysses.seq_to_head_many([q, k, v], comm, wire=wire)
            ulysses.head_to_seq(ulysses.seq_to_head(out, comm), comm, heads, wire=wire)
        t_bf16, t_fp8 = interleaved_medians(world, [functools.partial(exchange, None),
                                                    functools.partial(exchange, "float8")],
                                            repeats)
    rows.append({"test": "wire-time", "ranks": comm.size, **shape,
                 "bfloat16_s": t_bf16, "float8_s": t_fp8})
    return rows


def ulysses_shard(x, comm):
    return x[:, comm.rank * (x.shape[1] // comm.size):(comm.rank + 1) * (x.shape[1] // comm.size)]


TESTS = {"relayout": relayout, "fused": fused, "planner": planner, "overlap": overlap,
         "wire": wire}


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(sorted(TESTS)))
@click.option("--repeats", default=5, show_default=True)
@json_option
def main(tests, repeats: int, json_path: Optional[str]) -> None:
    """Ulysses relayout and planner benchmarks; run under mpiexec."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_ulysses: {comm.size} ranks (of {divisors(comm.size)})")
    rows = []
    for name in tests or sorted(TESTS):
        for row in TESTS[name](comm, world, repeats):
            rows.append(row)
            say(describe(row), flush=True)
    write_json(json_path, rows, comm.rank, default=str)
    comm.free()


if __name__ == "__main__":
    main()
