"""``commlib diag ring`` and ``commlib diag ulysses``: where an attention
shape's time goes on this launch, next to what the planner would pick.

    mpiexec -n 2 python -m commlib.tools.diag.attention ring --seq 4096 --causal
    mpiexec -n 2 python -m commlib.tools.diag.attention ulysses --heads 8

``ring`` replays ring_attention's schedule step by step (the same exchange,
block kernel, merge and causal visibility), so that each step's compute and
the communication it could not hide (the wait for the next block) are
measured apart; ``ulysses`` measures the all-to-all relayouts. Both then time
the library's own call for comparison and print the planner's pick for the
shape. Times are the slowest rank's (allreduce max), best of --iters after
one untimed warm-up. Run one BLAS thread per rank (OPENBLAS_NUM_THREADS=1)
when ranks share cores, or the kernels fight over them. Every rank runs,
rank 0 prints; usage errors are found from the arguments and the world size
alone, identically on every rank, before any communication, so that all
ranks exit 2 together.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import click
import ml_dtypes
import numpy as np

import commlib
from commlib import hybrid
from commlib import ring as ring_lib
from commlib import ulysses as ulysses_lib
from commlib.kernels import TILED
from commlib.sequence.blockwise import attend
from commlib.sequence.documents import packing_for
from commlib.sequence.visibility import blocks, bounds
from commlib.tools.world import world
from commlib.ulysses.relayout import FUSE_LIMIT_BYTES, divisors

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Shape:
    """The attention problem every rank builds its local shards of."""

    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    iters: int

    @property
    def element(self) -> np.dtype:
        """NumPy's dtype; bfloat16 comes from ml_dtypes (NumPy has none)."""
        return np.dtype(getattr(ml_dtypes, self.dtype, self.dtype))

    def local_inputs(self, size: int, rank: int) -> Tuple[np.ndarray, ...]:
        """Random q [1, seq/P, heads, d] and k, v [1, seq/P, kv_heads, d]:
        timing needs shards of the right shape, not a real sequence."""
        rng = np.random.default_rng(rank)
        local = self.seq // size
        return tuple(rng.standard_normal((1, local, h, self.head_dim), dtype=np.float32)
                     .astype(self.element) for h in (self.heads, self.kv_heads, self.kv_heads))


# -- options and usage checks ---------------------------------------------------------
_SHAPE_OPTIONS = (
    click.option("--seq", type=click.IntRange(min=1), default=4096, show_default=True,
                 help="Global sequence length (split over the ranks)."),
    click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True,
                 help="Query heads."),
    click.option("--kv-heads", type=click.IntRange(min=1), default=None,
                 help="Key/value heads (GQA/MQA); must divide --heads.  [default: --heads]"),
    click.option("--head-dim", type=click.IntRange(min=1), default=64, show_default=True,
                 help="Head dimension."),
    click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
                 help="Element type of q, k and v."),
    click.option("--causal", is_flag=True, help="Causal mask."),
    click.option("--iters", type=click.IntRange(min=1), default=3, show_default=True,
                 help="Timed iterations (after one untimed warm-up)."),
    click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
                 default=None, help="Also write the results to this file as one JSON object."),
)


def shape_options(command: Callable) -> Callable:
    """Give a command the shared shape options, handed to it as one
    ``shape: Shape`` once --kv-heads is known to divide --heads."""
    @functools.wraps(command)
    def with_shape(*args, seq: int, heads: int, kv_heads: Optional[int], head_dim: int,
                   dtype: str, causal: bool, iters: int, **kwargs):
        kv_heads = heads if kv_heads is None else kv_heads
        if heads % kv_heads:
            raise click.BadParameter(
                f"{kv_heads} kv heads do not divide {heads} query heads (GQA/MQA needs "
                f"heads % kv_heads == 0); use one of {divisors(heads)}",
                param_hint="'--kv-heads'")
        shape = Shape(seq, heads, kv_heads, head_dim, dtype, causal, iters)
        return command(*args, shape=shape, **kwargs)

    for option in reversed(_SHAPE_OPTIONS):
        with_shape = option(with_shape)
    return with_shape


def check_ring(shape: Shape, layout: str, size: int) -> None:
    """The sequence must cut into P (contiguous) or 2P (zigzag) equal chunks."""
    chunks = 2 * size if layout == "zigzag" else size
    if shape.seq % chunks:
        raise click.BadParameter(
            f"{shape.seq} does not cut into {chunks} equal chunks ({layout} layout over "
            f"{size} ranks); use a multiple of {chunks}", param_hint="'--seq'")


def check_ulysses(shape: Shape, size: int) -> None:
    """Ulysses runs at degree = world size: every rank needs a head (heads
    that the degree does not divide split unevenly), and the sequence must
    split over the ranks."""
    if shape.heads < size:
        raise click.UsageError(
            f"{shape.heads} heads cannot split over a Ulysses degree of {size} (the world "
            f"size): every rank needs at least one head; use --heads {size} or more")
    if shape.seq % size:
        raise click.BadParameter(f"{shape.seq} does not split over {size} ranks; use a "
                                 f"multiple of {size}", param_hint="'--seq'")


# -- timing --------------------------------------------------------------------
def slowest_best(comm: commlib.Communicator, per_iter: np.ndarray) -> np.ndarray:
    """``per_iter`` [iters, ...] of the iteration whose slowest rank was
    fastest: one allreduce after the loop (no collective between timed
    iterations), and the best run rather than the mean, because on a shared
    machine the noise only ever adds time."""
    slowest = comm.allreduce(per_iter, op="max")
    totals = slowest.reshape(len(slowest), -1).sum(axis=1)
    return slowest[int(np.argmin(totals))]


def time_call(comm: commlib.Communicator, call: Callable[[], Any], iters: int) -> float:
    """Seconds of ``call`` on the slowest rank, best of ``iters`` after a
    warm-up; a barrier before each so skew between ranks is not counted."""
    call()
    times = np.empty((iters, 1))
    for i in range(iters):
        comm.barrier()
        start = time.perf_counter()
        call()
        times[i, 0] = time.perf_counter() - start
    return float(slowest_best(comm, times)[0])


def gbps(nbytes: float, seconds: float) -> Optional[float]:
    """GB/s, or None when nothing was measured to divide by."""
    return nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else None


def planner_pick(comm: commlib.Communicator, shape: Shape, layout: str) -> Dict[str, Any]:
    """hybrid.plan for this shape over shards in ``layout`` (collective: it
    probes the fabric once)."""
    picked = hybrid.plan(comm, shape.seq, shape.heads, shape.kv_heads, shape.head_dim,
                         shape.element.itemsize, causal=shape.causal, layout=layout)
    return {"ulysses_size": picked.ulysses_size, "ring_size": picked.ring_size,
            "method": picked.method, "predicted_seconds": picked.predicted_seconds,
            "explain": picked.explain()}


def planner_lines(pick: Dict[str, Any]) -> List[str]:
    """The pick on one line, then the planner's own explanation."""
    return [f"# planner: Ulysses {pick['ulysses_size']} x Ring {pick['ring_size']} "
            f"({pick['method']}), "
            f"predicted {pick['predicted_seconds'] * 1e3:.2f} ms per forward",
            "# " + pick["explain"]]


def header(command: str, comm: commlib.Communicator, shape: Shape, extra: str = "") -> str:
    """The first line: world and shape, so a pasted output says what it measured."""
    ranks = f"{comm.size} rank{'s' if comm.size != 1 else ''}"
    return (f"# commlib diag {command}: {ranks}, seq {shape.seq}, heads {shape.heads}, "
            f"kv_heads {shape.kv_heads}, head_dim {shape.head_dim}, {shape.dtype}"
            f"{', causal' if shape.causal else ''}{extra}, {shape.iters} iters")


def report(comm: commlib.Communicator, lines: List[str], json_path: Optional[str],
           record: Dict[str, Any]) -> None:
    """Rank 0 prints the lines and writes the JSON record."""
    if comm.rank != 0:
        return
    click.echo("\n".join(lines))
    if json_path:
        with open(json_path, "w") as stream:
            json.dump(record, stream, indent=2)


# -- ring ----------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One ring step on the slowest rank: the block's source as rank 0 sees
    it, its compute, and the exposed wait for the next step's block."""

    step: int
    source: int
    compute_s: float
    exposed_comm_s: float


def ring_schedule(comm: commlib.Communicator, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  causal: bool, layout: str) -> np.ndarray:
    """[P, 2] seconds on this rank: compute of step i, and the time spent in
    the exchange getting step i+1's block (what compute did not hide; zero
    after the last step). The first block is this rank's own: no wait."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    steps = ring_lib.RingExchange(comm).rotate(np.stack([k, v]))  # K, V: one message
    times = np.zeros((comm.size, 2))
    packing = packing_for(None, layout, comm.size, q.shape[1])
    state = None
    source, block = next(steps)
    for step in range(comm.size):
        start = time.perf_counter()
        visible = blocks(packing.spans(comm.rank), packing.spans(source), *bounds(causal, None))
        state = attend(TILED, q, block[0], block[1], visible, scale, state)
        waited = time.perf_counter()
        source, block = next(steps, (None, None))
        times[step] = (waited - start, time.perf_counter() - waited)
    return times



def ring_steps(comm: commlib.Communicator, shape: Shape, layout: str) -> List[Step]:
    """The schedule timed ``shape.iters`` times after a warm-up, each run
    from a barrier; the best run's steps, each its slowest rank's numbers."""
    q, k, v = shape.local_inputs(comm.size, comm.rank)
    ring_schedule(comm, q, k, v, shape.causal, layout)
    runs = np.empty((shape.iters, comm.size, 2))
    for i in range(shape.iters):
        comm.barrier()
        runs[i] = ring_schedule(comm, q, k, v, shape.causal, layout)
    best = slowest_best(comm, runs)
    return [Step(step, (0 - step) % comm.size, float(compute), float(exposed))
            for step, (compute, exposed) in enumerate(best)]


def ring_totals(comm: commlib.Communicator, shape: Shape, layout: str,
                steps: List[Step]) -> Dict[str, Any]:
    """Sums over the steps, the hop size and the hop bandwidth the compute
    saw (bytes per hop over exposed time per hop: above the link's rate
    when compute hides part of each hop), and ring_attention's own time."""
    q, k, v = shape.local_inputs(comm.size, comm.rank)
    hops = comm.size - 1
    hop_bytes = 2 * k.nbytes
    exposed = sum(step.exposed_comm_s for step in steps)
    whole = time_call(comm, lambda: ring_lib.ring_attention(q, k, v, comm, layout=layout,
                                                            causal=shape.causal), shape.iters)
    return {"compute_s": sum(step.compute_s for step in steps), "exposed_comm_s": exposed,
            "hops": hops, "hop_bytes": hop_bytes,
            "effective_hop_gbps": gbps(hop_bytes * hops, exposed), "ring_attention_s": whole}


def ring_lines(steps: List[Step], totals: Dict[str, Any]) -> List[str]:
    """The step table and the totals under it."""
    loop = totals["compute_s"] + totals["exposed_comm_s"]
    bandwidth = totals["effective_hop_gbps"]
    lines = ["#   step  source(rank 0)  compute (ms)  exposed comm (ms)"]
    lines += [f"  {s.step:>5} {s.source:>15} {s.compute_s * 1e3:>13.3f} "
              f"{s.exposed_comm_s * 1e3:>18.3f}" for s in steps]
    return lines + [
        f"# total: compute {totals['compute_s'] * 1e3:.3f} ms, exposed comm "
        f"{totals['exposed_comm_s'] * 1e3:.3f} ms "
        f"({100 * totals['exposed_comm_s'] / loop if loop else 0:.1f}% of the step loop)",
        f"# ring: {totals['hop_bytes']} bytes per hop x {totals['hops']} hops, effective hop "
        f"bandwidth " + ("n/a (no hop)" if bandwidth is None else f"{bandwidth:.3f} GB/s"),
        f"# ring_attention: {totals['ring_attention_s'] * 1e3:.3f} ms "
        f"(step loop {loop * 1e3:.3f} ms)"]


@click.command("ring")
@shape_options
@click.option("--layout", type=click.Choice(("contiguous", "zigzag")), default="zigzag",
              show_default=True, help="How the sequence is cut among the ranks.")
def ring(shape: Shape, layout: str, json_path: Optional[str]) -> None:
    """Ring Attention step by step: compute and exposed communication per
    step, hop bandwidth, ring_attention's time and the planner's pick."""
    with world(lambda size: check_ring(shape, layout, size)) as comm:
        steps = ring_steps(comm, shape, layout)
        totals = ring_totals(comm, shape, layout, steps)
        pick = planner_pick(comm, shape, layout)
        lines = [header("ring", comm, shape, f", {layout} layout"), *ring_lines(steps, totals),
                 *planner_lines(pick)]
        report(comm, lines, json_path,
               {"command": "ring", "config": config(comm, shape, layout=layout),
                "steps": [asdict(step) for step in steps], "totals": totals, "planner": pick})


def config(comm: commlib.Communicator, shape: Shape, **extra: Any) -> Dict[str, Any]:
    """The JSON record's settings: enough to rerun the same measurement."""
    return {"world_size": comm.size, **asdict(shape), **extra}


# -- ulysses -------------------------------------------------------------------
def relayouts(comm: commlib.Communicator, shape: Shape) -> Dict[str, Any]:
    """seq_to_head and head_to_seq of q, and q/k/v relaid by
    seq_to_head_many against three seq_to_head calls. GB/s counts the bytes
    that leave a rank (size * (P-1)/P of what it holds)."""
    q, k, v = shape.local_inputs(comm.size, comm.rank)
    heads_q = ulysses_lib.seq_to_head(q, comm)
    leaving = q.nbytes * (comm.size - 1) / comm.size
    forward = time_call(comm, lambda: ulysses_lib.seq_to_head(q, comm), shape.iters)
    back = time_call(comm, lambda: ulysses_lib.head_to_seq(heads_q, comm), shape.iters)
    fused = time_call(comm, lambda: ulysses_lib.seq_to_head_many([q, k, v], comm), shape.iters)
    three = time_call(comm, lambda: [ulysses_lib.seq_to_head(x, comm) for x in (q, k, v)],
                      shape.iters)
    per_peer = (q.nbytes + k.nbytes + v.nbytes) // comm.size
    return {"bytes_per_rank": q.nbytes, "bytes_leaving_rank": leaving,
            "seq_to_head_s": forward, "seq_to_head_gbps": gbps(leaving, forward),
            "head_to_seq_s": back, "head_to_seq_gbps": gbps(leaving, back),
            "qkv_many_s": fused, "qkv_three_calls_s": three,
            "qkv_one_message": per_peer <= FUSE_LIMIT_BYTES}


def ulysses_lines(numbers: Dict[str, Any], whole: float) -> List[str]:
    """The relayout table, the q/k/v comparison and the attention time."""
    def rate(key: str) -> str:
        value = numbers[key]
        return "n/a" if value is None else f"{value:.3f}"

    many = "one message per peer" if numbers["qkv_one_message"] else \
        f"one all-to-all per tensor (over {FUSE_LIMIT_BYTES} bytes per peer)"
    return [
        "#   relayout        bytes out/rank   time (ms)   GB/s per rank",
        f"  {'seq_to_head':<15} {numbers['bytes_leaving_rank']:>15.0f} "
        f"{numbers['seq_to_head_s'] * 1e3:>11.3f} {rate('seq_to_head_gbps'):>15}",
        f"  {'head_to_seq':<15} {numbers['bytes_leaving_rank']:>15.0f} "
        f"{numbers['head_to_seq_s'] * 1e3:>11.3f} {rate('head_to_seq_gbps'):>15}",
        f"# q/k/v: seq_to_head_many {numbers['qkv_many_s'] * 1e3:.3f} ms ({many}) vs three "
        f"seq_to_head calls {numbers['qkv_three_calls_s'] * 1e3:.3f} ms",
        f"# ulysses_attention: {whole * 1e3:.3f} ms"]


@click.command("ulysses")
@shape_options
def ulysses(shape: Shape, json_path: Optional[str]) -> None:
    """Ulysses relayout bandwidth (seq_to_head, head_to_seq, fused q/k/v),
    ulysses_attention's time and the planner's pick."""
    with world(lambda size: check_ulysses(shape, size)) as comm:
        numbers = relayouts(comm, shape)
        q, k, v = shape.local_inputs(comm.size, comm.rank)
        whole = time_call(comm, lambda: ulysses_lib.ulysses_attention(
            q, k, v, comm, layout="contiguous", causal=shape.causal),
                          shape.iters)
        pick = planner_pick(comm, shape, "contiguous")
        lines = [header("ulysses", comm, shape), *ulysses_lines(numbers, whole),
                 *planner_lines(pick)]
        report(comm, lines, json_path,
               {"command": "ulysses", "config": config(comm, shape), "relayout": numbers,
                "totals": {"ulysses_attention_s": whole}, "planner": pick})


if __name__ == "__main__":
    @click.group(context_settings={"help_option_names": ["-h", "--help"]})
    def main() -> None:
        """Attention diagnostics (also ``commlib diag ring|ulysses``)."""

    main.add_command(ring)
    main.add_command(ulysses)
    main()
