"""MoE dispatch + combine on this machine, every timing against a baseline
run in the same launch, interleaved, the slowest rank's time per iteration,
the median reported.

    mpiexec -n 4 python -m commlib.tools.bench.moe throughput --ranks-per-node 2
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe modes
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe latency
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe decode
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe overlap
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe frameworks

``throughput``: commlib (flat, two-hop) against a hand-written mpi4py
dispatcher that sends every token-expert pair (the Megatron-style path),
identity experts. ``modes``: FP8 against the input dtype, the fixed capacity
against the counted dispatch (DeepSeek-V3's 7168 hidden, top-8 of 64, torch
bfloat16). ``latency``: the fixed cost of ``alltoall``/``alltoallv`` against
mpi4py's ``Alltoall`` and count exchange + ``Alltoallv``. ``decode``: a
dispatch + combine pair of 1 to 512 tokens, counted and fixed, torch and
NumPy, against the bare mpi4py exchange of the same bytes. ``overlap``:
two micro-batches with an expert MLP between dispatch and combine,
sequential against overlapped with the async handles: how much of the
communication the overlap hides.
``frameworks``: one line per framework's MoE path (NumPy, torch, JAX under
jit, CuPy where CUDA is) for the same problem, against the bare mpi4py
exchange of the same bytes.
"""

from __future__ import annotations

import functools
import math
from itertools import accumulate
from typing import Any, Callable, Dict, List, Optional, Tuple

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.ops import warm_torch_ops
from commlib.tools.bench.timing import interleaved, json_option, repeated, write_json


def megatron_style(world: MPI.Comm, num_experts: int) -> Callable:
    """Every (token, expert) pair is its own row on the wire: permute by
    destination, count exchange, Alltoallv there and back, weighted sum."""
    size = world.Get_size()
    per_rank = num_experts // size

    def run(x, experts, weights):
        tokens, k = experts.shape
        pair_token = np.repeat(np.arange(tokens), k)
        dest = experts.reshape(-1) // per_rank
        order = np.argsort(dest, kind="stable")
        send = x[pair_token[order]]
        counts = np.bincount(dest, minlength=size).astype(np.int64)
        recv_counts = np.empty_like(counts)
        world.Alltoall(counts, recv_counts)
        row = x.shape[1] * x.itemsize
        received = np.empty((int(recv_counts.sum()), x.shape[1]), x.dtype)
        world.Alltoallv([send, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE],
                        [received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE])
        back = np.empty_like(send)  # identity experts: the rows go straight back
        world.Alltoallv([received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE],
                        [back, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE])
        per_pair = np.empty_like(back)
        per_pair[order] = back
        weighted = per_pair.reshape(tokens, k, -1) * weights[..., None]
        return weighted.sum(axis=1), int(send.nbytes)
    return run


class PlainSlots:
    """The decode pair a user writes by hand in torch + mpi4py (issue 46's
    baseline, DeepEP's low-latency layout): every expert has ``capacity``
    slots per source rank, a token's slot is its row, so placing the rows
    is one ``index_copy_``; one ``Alltoall`` each way over buffers made
    once; identity experts; each token's results gathered and summed with
    its weights. No checks, no statistics, no agreement."""

    def __init__(self, world: MPI.Comm, num_experts: int, capacity: int, hidden: int) -> None:
        import torch

        self.world, self.capacity = world, capacity
        size = world.Get_size()
        self.local = num_experts // size
        self.send = torch.zeros(num_experts * capacity, hidden, dtype=torch.bfloat16)
        self.received = torch.zeros(size, self.local, capacity, hidden, dtype=torch.bfloat16)
        self.back = torch.zeros(num_experts * capacity, hidden, dtype=torch.bfloat16)

    def __call__(self, x, experts, weights):
        import torch

        tokens, k = experts.shape
        slots = (experts * self.capacity + torch.arange(tokens)[:, None]).reshape(-1)
        self.send.index_copy_(0, slots, x.repeat_interleave(k, dim=0))
        self.world.Alltoall(self.send.view(torch.int16).numpy(),
                            self.received.view(torch.int16).numpy())
        expert_x = self.received.transpose(0, 1)  # [local experts, source, slot, H]
        expert_y = expert_x.transpose(0, 1).contiguous()  # identity experts, sent back
        self.world.Alltoall(expert_y.view(torch.int16).numpy(),
                            self.back.view(torch.int16).numpy())
        rows = self.back.index_select(0, slots).view(tokens, k, -1)
        return torch.einsum("tk,tkh->th", weights, rows.float()).to(x.dtype)

    def bare(self) -> Callable[[], None]:
        """The same two ``Alltoall`` of the same buffers, nothing else."""
        import torch

        send, back = self.send.view(torch.int16).numpy(), self.back.view(torch.int16).numpy()
        received = self.received.view(torch.int16).numpy()

        def run() -> None:
            self.world.Alltoall(send, received)
            self.world.Alltoall(received, back)
        return run


def commlib_path(dispatcher: moe.Dispatcher) -> Callable:
    def run(x, experts, weights):
        expert_x, handle = dispatcher.dispatch(x, experts, weights)
        y = dispatcher.combine(expert_x, handle)
        run.stats = handle.stats
        return y, int(handle.stats.traffic[dispatcher.comm.rank].sum())
    return run


@click.group()
def main() -> None:
    """MoE benchmarks (see the module docstring)."""


@main.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", "num_experts", default=64, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--ranks-per-node", type=int, default=None,
              help="Emulate nodes of this many ranks (two-hop needs 2+ nodes).")
@click.option("--iters", default=5, show_default=True)
@json_option
def throughput(tokens: int, hidden: int, num_experts: int, topk: int,
               ranks_per_node: Optional[int], iters: int, json_path: Optional[str]) -> None:
    """Dispatch + combine: commlib (flat, two-hop) vs every-pair mpi4py."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", ranks_per_node=ranks_per_node, abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    experts, weights = moe.route(rng.standard_normal((tokens, num_experts)), topk)
    raw = world.Dup()
    contenders: Dict[str, Callable] = {
        "mpi4py every pair": megatron_style(raw, num_experts),
        "commlib flat": commlib_path(moe.Dispatcher(comm, num_experts)),
    }
    if comm.topology.num_nodes > 1:
        contenders["commlib two-hop"] = commlib_path(moe.Dispatcher(comm, num_experts,
                                                                    hierarchical=True))
    reference, _ = contenders["mpi4py every pair"](x, experts, weights)
    for name, run in contenders.items():
        y, _ = run(x, experts, weights)
        if not np.allclose(y, reference, atol=1e-4):
            raise AssertionError(f"{name} disagrees with the every-pair reference")
    times = interleaved(world, {name: functools.partial(run, x, experts, weights)
                                for name, run in contenders.items()}, iters, warmup=0)
    say(f"bench_moe throughput: {comm.size} ranks, {comm.topology.num_nodes} nodes; {tokens} "
        f"tokens x {hidden} float32 per rank, {num_experts} experts, top-{topk}; identity "
        f"experts")
    rows = []
    base = float(np.median(times["mpi4py every pair"]))
    for name, run in contenders.items():
        seconds = float(np.median(times[name]))
        _, sent = run(x, experts, weights)
        sent_total = world.allreduce(sent, op=MPI.SUM)
        row = {"contender": name, "seconds": seconds, "ratio_to_every_pair": seconds / base,
               "tokens_per_s": tokens * comm.size / seconds,
               "bytes_per_token": sent_total / (tokens * comm.size)}
        if hasattr(run, "stats"):
            row.update(inter_node_bytes=run.stats.inter_node_bytes,
                       intra_node_bytes=run.stats.intra_node_bytes,
                       imbalance=run.stats.imbalance)
        rows.append(row)
        nodes = (f", inter-node {row['inter_node_bytes'] / 2**20:.1f} MiB, intra-node "
                 f"{row['intra_node_bytes'] / 2**20:.1f} MiB" if "inter_node_bytes" in row else "")
        say(f"{name:>18}: {seconds * 1e3:8.1f} ms ({row['ratio_to_every_pair']:.2f}x), "
            f"{row['tokens_per_s'] / 1e3:7.1f} k tokens/s, {row['bytes_per_token']:7.0f} "
            f"payload B/token dispatched{nodes}", flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()


def torch_routing(comm, tokens: int, hidden: int, num_experts: int, topk: int, seed: int = 0):
    """bf16 torch rows and a top-k softmax routing, this rank's own."""
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng([seed, comm.rank])
    x = torch.from_numpy(rng.standard_normal((tokens, hidden), dtype=np.float32)).bfloat16()
    experts, weights = moe.route(torch.from_numpy(rng.standard_normal(
        (tokens, num_experts)).astype(np.float32)), topk)
    return x, experts, weights


def dispatch_combine(d: moe.Dispatcher, x, experts, weights, quantize: Optional[str] = None):
    """Dispatch + combine with identity experts (FP8 rows dequantized)."""
    def run():
        expert_x, handle = d.dispatch(x, experts, weights, quantize=quantize,
                                      dequantize=quantize is not None)
        return d.combine(expert_x, handle)
    return run


@main.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--small-tokens", default=8, show_default=True,
              help="The fixed capacity's home ground: a decode step's tokens per rank.")
@click.option("--hidden", default=7168, show_default=True)
@click.option("--experts", "num_experts", default=64, show_default=True)
@click.option("--topk", default=8, show_default=True)
@click.option("--capacity-factor", default=1.25, show_default=True,
              help="Both modes; it also sizes the fixed capacity's expert slots (without "
                   "one they would be P x tokens per expert).")
@click.option("--iters", default=5, show_default=True)
@json_option
def modes(tokens: int, small_tokens: int, hidden: int, num_experts: int, topk: int,
          capacity_factor: float, iters: int, json_path: Optional[str]) -> None:
    """FP8 vs bfloat16 rows, fixed capacity vs counted: dispatch alone and
    the dispatch + combine pair, and the payload bytes."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_moe modes: {comm.size} ranks; {hidden} bfloat16 channels, {num_experts} "
        f"experts, top-{topk}, capacity factor {capacity_factor}; identity experts; torch")
    rows = []
    for count in (tokens, small_tokens):
        x, experts, weights = torch_routing(comm, count, hidden, num_experts, topk)
        counted = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor)
        fixed = moe.Dispatcher(comm, num_experts, capacity_factor=capacity_factor,
                               max_tokens_per_rank=count)
        contenders = {}
        for mode, d in (("counted", counted), ("fixed", fixed)):
            for quantize in (None, "fp8"):
                name = f"{mode} {'fp8' if quantize else 'bf16'}"
                contenders[f"{name} dispatch"] = functools.partial(
                    d.dispatch, x, experts, weights, quantize=quantize)
                contenders[f"{name} pair"] = dispatch_combine(d, x, experts, weights, quantize)
        times = interleaved(world, contenders, iters)
        counted.stats = moe.DispatchStats.zeros(num_experts, comm.size)
        counted.dispatch(x, experts, weights)
        wide = int(counted.stats.traffic.sum())
        counted.dispatch(x, experts, weights, quantize="fp8")
        narrow = int(counted.stats.traffic.sum()) - wide
        fixed.collect_stats()
        # rows per destination, padded: the layout of the path the fixed dispatches took
        blocks = fixed.path_for(x).layout(x, topk, hidden * 2)["hops"][0][3]
        wire = {None: hidden * 2 + 8 * topk, "fp8": hidden + 4 * -(-hidden // 128) + 8 * topk}
        say(f"-- {count} tokens per rank: payload per dispatch (all ranks) bf16 "
            f"{wide / 2**20:.2f} MiB, fp8 {narrow / 2**20:.2f} MiB ({narrow / wide:.3f}); "
            f"the fixed capacity sends {int(blocks.sum())} rows a rank a hop whatever the "
            f"routing (bf16 {int(blocks.sum()) * wire[None] * comm.size / 2**20:.2f} MiB, "
            f"fp8 {int(blocks.sum()) * wire['fp8'] * comm.size / 2**20:.2f} MiB on the wire)")
        base = {kind: float(np.median(times[f"counted bf16 {kind}"])) for kind in
                ("dispatch", "pair")}
        for name, seconds in times.items():
            kind = name.rsplit(" ", 1)[1]
            median = float(np.median(seconds))
            rows.append({"tokens": count, "contender": name, "seconds": median,
                         "ratio_to_counted_bf16": median / base[kind],
                         "payload_bytes": narrow if "fp8" in name else wide})
            say(f"{name:>22}: {median * 1e3:9.3f} ms ({median / base[kind]:.2f}x counted "
                f"bf16)", flush=True)
    write_json(json_path, rows, comm.rank)
    comm.free()


def _alltoallv_bytes(raw, rows: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
    """mpi4py's ``Alltoallv`` of whole rows, in bytes, counts as Python
    lists (the leanest spelling for a handful of ranks)."""
    row = rows.itemsize * math.prod(rows.shape[1:])
    result = np.empty((sum(recv),) + rows.shape[1:], rows.dtype)
    send_bytes, recv_bytes = [n * row for n in send], [n * row for n in recv]
    raw.Alltoallv([rows, (send_bytes, list(accumulate(send_bytes[:-1], initial=0))), MPI.BYTE],
                  [result, (recv_bytes, list(accumulate(recv_bytes[:-1], initial=0))),
                   MPI.BYTE])
    return result


def counted_exchange(raw, x: np.ndarray, counts: np.ndarray) -> Callable[[], np.ndarray]:
    """What a careful mpi4py caller writes for a variable all-to-all: the
    count exchange (typed, into a buffer kept across calls), the output,
    ``Alltoallv``."""
    received = np.empty_like(counts)

    def run() -> np.ndarray:
        raw.Alltoall([counts, MPI.INT64_T], [received, MPI.INT64_T])
        return _alltoallv_bytes(raw, x, counts.tolist(), received.tolist())
    return run


def there_and_back(raw, rows: np.ndarray, counts: np.ndarray,
                   back_bytes: Optional[int] = None) -> Callable[[], None]:
    """The bare exchange of a dispatch + combine's bytes: the count
    exchange, ``rows`` out, and back (its counts known) what arrived, or
    rows of ``back_bytes`` each (combine returns sums without the ids and
    weights)."""
    received = np.empty_like(counts)

    def run() -> None:
        raw.Alltoall([counts, MPI.INT64_T], [received, MPI.INT64_T])
        there, back = counts.tolist(), received.tolist()
        arrived = _alltoallv_bytes(raw, rows, there, back)
        if back_bytes is not None:  # the first bytes, as rows of back_bytes: no copy
            arrived = arrived.reshape(-1)[:arrived.shape[0] * back_bytes].reshape(-1, back_bytes)
        _alltoallv_bytes(raw, arrived, back, there)
    return run


def _framework_paths(comm, num_experts: int, x: np.ndarray, experts: np.ndarray,
                     weights: np.ndarray) -> Tuple[Dict[str, Any], int]:
    """The MoE path of every framework here, each a dispatch + combine of
    the same rows with identity experts (the Dispatcher's defaults) and its
    result as NumPy, and the rows of the JAX layout's send buffer: the core on
    NumPy arrays, the torch Dispatcher (autograd functions over the core),
    the JAX Dispatcher under ``jax.jit`` (its own padded layout), and the
    core on CuPy arrays where CUDA is."""
    paths: Dict[str, Any] = {}
    numpy_d = moe.Dispatcher(comm, num_experts)
    paths["NumPy core"] = (lambda: numpy_d.combine(*numpy_d.dispatch(x, experts, weights)),
                           lambda y: y)
    import torch

    from commlib.bindings.torch import Dispatcher as TorchDispatcher
    torch.set_num_threads(1)
    torch_d = TorchDispatcher(comm, num_experts)
    tx, te, tw = (torch.from_numpy(a) for a in (x, experts, weights))
    paths["torch Dispatcher"] = (lambda: torch_d.combine(*torch_d.dispatch(tx, te, tw)),
                                 lambda y: y.numpy())
    import jax
    import jax.numpy as jnp

    from commlib.bindings.jax import Dispatcher as JaxDispatcher
    jax_d = JaxDispatcher(comm, num_experts)
    jx, je, jw = jnp.asarray(x), jnp.asarray(experts.astype(np.int32)), jnp.asarray(weights)
    jax_pair = jax.jit(lambda x, e, w: jax_d.combine(*jax_d.dispatch(x, e, w)))
    paths["JAX Dispatcher (jit)"] = (lambda: jax_pair(jx, je, jw).block_until_ready(),
                                     np.asarray)
    cupy = _cupy()
    if cupy is not None:
        cupy_d = moe.Dispatcher(comm, num_experts)
        cx, ce, cw = (cupy.asarray(a) for a in (x, experts, weights))

        def cupy_pair():
            y = cupy_d.combine(*cupy_d.dispatch(cx, ce, cw))
            cupy.cuda.get_current_stream().synchronize()
            return y
        paths["CuPy core"] = (cupy_pair, cupy.asnumpy)
    return paths, num_experts * jax_d.capacity(*experts.shape)


def _cupy() -> Any:
    """CuPy where it imports and sees a CUDA device, else None."""
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, or no driver: no CuPy line
        return None


@main.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", "num_experts", default=8, show_default=True)
@click.option("--topk", default=2, show_default=True)
@click.option("--iters", default=15, show_default=True)
@json_option
def frameworks(tokens: int, hidden: int, num_experts: int, topk: int, iters: int,
               json_path: Optional[str]) -> None:
    """One line per framework's MoE path (NumPy core, torch Dispatcher, JAX
    Dispatcher under jit, CuPy core where CUDA is) for the same float32
    rows and routing, identity experts, each against the bare mpi4py
    exchange of the counted dispatch's bytes (count exchange, ``Alltoallv``
    of the rows with their ids and weights there, of the rows back),
    interleaved in one launch: a change that speeds one path is measured in
    all. The JAX Dispatcher moves its padded layout (every expert's
    ``capacity`` slots from every rank); its line also gives the ratio to a
    bare ``Alltoall`` of those bytes there and back."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    experts, weights = moe.route(rng.standard_normal((tokens, num_experts)), topk)
    weights = weights.astype(np.float32)
    paths, padded_rows = _framework_paths(comm, num_experts, x, experts, weights)
    reference = paths["NumPy core"][0]()
    for name, (run, as_numpy) in paths.items():
        if not np.allclose(as_numpy(run()), reference, atol=1e-5):
            raise AssertionError(f"{name} disagrees with the NumPy core")
    _, handle = moe.Dispatcher(comm, num_experts).dispatch(x, experts, weights)
    there = np.asarray(handle.route.send_counts, np.int64)
    row_bytes = hidden * 4 + 8 * topk
    counted = there_and_back(raw, np.zeros((int(there.sum()), row_bytes), np.uint8), there,
                             back_bytes=hidden * 4)
    padded = np.zeros((padded_rows, hidden * 4), np.uint8)
    padded_back = np.empty_like(padded)

    def padded_exchange() -> None:
        raw.Alltoall(padded, padded_back)
        raw.Alltoall(padded_back, padded)
    contenders = {"mpi4py bare exchange": counted, "mpi4py bare Alltoall (padded)":
                  padded_exchange}
    contenders.update({name: run for name, (run, _) in paths.items()})
    times = {name: float(np.median(t))
             for name, t in interleaved(world, contenders, iters).items()}
    sent = {"counted": int(there.sum()) * row_bytes, "padded": padded.nbytes}
    say(f"bench_moe frameworks: {comm.size} ranks; {tokens} tokens x {hidden} float32 per "
        f"rank, {num_experts} experts, top-{topk}, no capacity factor; identity experts; "
        f"dispatch + combine, median of {iters}, slowest rank; sent per rank on dispatch: "
        f"{sent['counted'] / 2**20:.1f} MiB deduplicated, {sent['padded'] / 2**20:.1f} MiB "
        f"padded (JAX)")
    bare, bare_padded = times["mpi4py bare exchange"], times["mpi4py bare Alltoall (padded)"]
    rows = []
    for name, seconds in times.items():
        row = {"contender": name, "seconds": seconds, "ratio_to_bare": seconds / bare}
        note = ""
        if name.startswith("JAX"):
            row["ratio_to_bare_padded"] = seconds / bare_padded
            note = f", {seconds / bare_padded:.2f}x the padded Alltoall"
        rows.append(row)
        say(f"{name:>30}: {seconds * 1e3:8.1f} ms ({seconds / bare:.2f}x bare{note})",
            flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()


@main.command()
@click.option("--sizes", default="1K,64K", show_default=True,
              help="Bytes per destination, comma-separated (K = 1024).")
@click.option("--repeat", default=200, show_default=True, help="Calls per timed unit.")
@click.option("--iters", default=15, show_default=True)
@json_option
def latency(sizes: str, repeat: int, iters: int, json_path: Optional[str]) -> None:
    """The fixed cost of a call: commlib's alltoall / alltoallv against
    mpi4py's Alltoall / count exchange + Alltoallv, same bytes."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    size = comm.size
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_moe latency: {size} ranks, {repeat} calls a unit, median of {iters} units, "
        f"slowest rank")
    rows = []
    for text in sizes.split(","):
        per_peer = int(text.upper().replace("K", "")) * (1024 if "K" in text.upper() else 1)
        x = np.ones((size, per_peer // 4), np.float32)
        out = np.empty_like(x)
        counts = np.full(size, 1, np.int64)

        contenders = {
            "mpi4py Alltoall": repeated(functools.partial(raw.Alltoall, x, out), repeat),
            "commlib alltoall": repeated(functools.partial(comm.alltoall, x), repeat),
            "mpi4py counts + Alltoallv": repeated(counted_exchange(raw, x, counts), repeat),
            "commlib alltoallv": repeated(functools.partial(comm.alltoallv, x, counts), repeat),
            "commlib alltoallv (recv counts given)":
                repeated(functools.partial(comm.alltoallv, x, counts, counts), repeat),
        }
        times = {name: float(np.median(t)) / repeat * 1e6
                 for name, t in interleaved(world, contenders, iters).items()}
        gaps = {"commlib alltoall": "mpi4py Alltoall",
                "commlib alltoallv": "mpi4py counts + Alltoallv",
                "commlib alltoallv (recv counts given)": "mpi4py counts + Alltoallv"}
        say(f"-- {text} per destination")
        for name, micros in times.items():
            baseline = gaps.get(name)
            gap = f"  (+{micros - times[baseline]:.1f} us over {baseline})" if baseline else ""
            rows.append({"bytes_per_destination": per_peer, "contender": name, "us": micros,
                         "gap_us": micros - times[baseline] if baseline else 0.0})
            say(f"{name:>38}: {micros:7.1f} us{gap}", flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()


@main.command()
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


@main.command()
@click.option("--tokens", default=1024, show_default=True, help="Tokens per micro-batch.")
@click.option("--hidden", default=2048, show_default=True)
@click.option("--ffn", default=1024, show_default=True, help="The expert MLP's inner width.")
@click.option("--experts", "num_experts", default=16, show_default=True)
@click.option("--topk", default=4, show_default=True)
@click.option("--fixed", is_flag=True, help="The fixed-capacity mode.")
@click.option("--iters", default=5, show_default=True)
@json_option
def overlap(tokens: int, hidden: int, ffn: int, num_experts: int, topk: int, fixed: bool,
            iters: int, json_path: Optional[str]) -> None:
    """Two micro-batches, an expert MLP (torch float32, one thread) between
    dispatch and combine. Sequential: A's dispatch, MLP, combine, then B's.
    Overlapped (DualPipe's pairing): both dispatches started, A's MLP while
    B's dispatch is in flight, A's combine started before B's MLP. Hidden =
    (sequential - overlapped) / (sequential - MLP alone)."""
    import torch

    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    torch.set_num_threads(1)
    local = num_experts // comm.size
    generator = torch.Generator().manual_seed(comm.rank)
    w_in = torch.randn(local, hidden, ffn, generator=generator) / hidden ** 0.5
    w_out = torch.randn(local, ffn, hidden, generator=generator) / ffn ** 0.5
    batches = []
    for seed in (0, 1):
        x, experts, weights = torch_routing(comm, tokens, hidden, num_experts, topk, seed)
        batches.append((x.float(), experts, weights))
    d = moe.Dispatcher(comm, num_experts, max_tokens_per_rank=tokens if fixed else None)

    def mlp(expert_x, handle):
        if expert_x.ndim == 3:  # fixed capacity: every slot, padding included
            return torch.bmm(torch.relu(torch.bmm(expert_x, w_in)), w_out)
        chunks = torch.split(expert_x, handle.tokens_per_expert.tolist())
        return torch.cat([torch.relu(c @ w_in[e]) @ w_out[e] for e, c in enumerate(chunks)])

    dispatched = [d.dispatch(*b) for b in batches]

    def sequential():
        for batch in batches:
            expert_x, handle = d.dispatch(*batch)
            d.combine(mlp(expert_x, handle), handle)

    def overlapped():
        started = [d.dispatch_async(*b) for b in batches]
        first = started[0].wait()
        combining = d.combine_async(mlp(*first), first[1])  # B's dispatch in flight
        second = started[1].wait()
        last = d.combine_async(mlp(*second), second[1])  # A's combine in flight
        combining.wait()
        last.wait()

    def compute_alone():
        for expert_x, handle in dispatched:
            mlp(expert_x, handle)
    times = {name: float(np.median(t)) for name, t in interleaved(
        world, {"sequential": sequential, "overlapped": overlapped,
                "expert MLP alone": compute_alone}, iters).items()}
    communication = times["sequential"] - times["expert MLP alone"]
    hidden_fraction = (times["sequential"] - times["overlapped"]) / communication
    say(f"bench_moe overlap: {comm.size} ranks; 2 micro-batches of {tokens} tokens x {hidden} "
        f"float32, {num_experts} experts top-{topk}, MLP {hidden}->{ffn}->{hidden}; "
        f"{'fixed capacity' if fixed else 'counted'}")
    for name, seconds in times.items():
        say(f"{name:>18}: {seconds * 1e3:8.1f} ms")
    say(f"communication (sequential - MLP): {communication * 1e3:.1f} ms; hidden by the "
        f"overlap: {hidden_fraction * 100:.0f}%")
    write_json(json_path, [dict(times, communication=communication,
                                hidden_fraction=hidden_fraction, fixed=fixed)], comm.rank)
    comm.free()


if __name__ == "__main__":
    main()
