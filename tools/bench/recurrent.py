"""Context parallelism for recurrent mixers (issue 39): what it moves and
what it costs.

    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.recurrent bytes
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.recurrent mixers
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.recurrent train

``bytes``: the bytes a rank receives for one layer's forward and backward
(``incoming_state``, its backward, the convolution's ``halo`` and its
backward) at growing sequence lengths: flat in the length, against a ring
attention layer's K/V, which grows with it. ``mixers``: the sharded Gated
DeltaNet and Mamba2 scans (forward + backward, torch float32, one thread a
rank) against transformers' single-process chunked functions on the whole
sequence with every core (``--threads``), and ``incoming_state`` alone
against mpi4py's ``Allgather`` of the same bytes. ``train``: a
Qwen3-Next-shaped model's training step, sharded, against the same model
in one process.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib import recurrent
from commlib.bindings.torch import gated_delta_rule, mamba2_scan
from commlib.ring import shard_sequence
from commlib.tools.bench.timing import (
    best_local,
    best_slowest,
    first_rank_alone,
    json_option,
    write_json,
)


class _CountingComm:
    """``comm`` with the bytes each all-gather and all-to-all delivered to
    this rank from the others added up (agreement traffic left out)."""

    def __init__(self, comm: commlib.Communicator):
        self._comm = comm
        self.received = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def allgather(self, x: Any, axis: int = 0) -> Any:
        out = self._comm.allgather(x, axis=axis)
        self.received += out.nbytes - x.nbytes
        return out

    def alltoall(self, x: Any, split_axis: int = 0, concat_axis: int = 0, **kw: Any) -> Any:
        out = self._comm.alltoall(x, split_axis, concat_axis, **kw)
        self.received += out.nbytes - x.nbytes // self._comm.size
        return out


@click.group()
def main() -> None:
    """Recurrent-mixer benchmarks (see the module docstring)."""


@main.command("bytes")
@click.option("--lengths", default="4096,32768,262144", show_default=True,
              help="Global sequence lengths, comma-separated.")
@click.option("--heads", default=32, show_default=True)
@click.option("--head-dim", default=128, show_default=True, help="dk = dv of the delta rule.")
@click.option("--channels", default=8192, show_default=True,
              help="The convolution's channels (q, k and v together).")
@click.option("--layout", default="zigzag", show_default=True)
@json_option
def moved(lengths: str, heads: int, head_dim: int, channels: int, layout: str,
          json_path: Optional[str]) -> None:
    """Bytes received per rank for one Gated DeltaNet layer (float32 state
    [heads, dk, dv], kernel-4 convolution) against a ring attention layer's
    K/V (bfloat16, ``heads`` x ``head_dim``) at the same length."""
    comm = commlib.init(backend="mpi")
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench_recurrent bytes: {comm.size} ranks, {layout}; state {heads} x {head_dim} x "
        f"{head_dim} float32, halo of 3 tokens x {channels} float32; MiB received per rank")
    rows = []
    for length in (int(n) for n in lengths.split(",")):
        local = shard_sequence(np.zeros((1, length, 1), np.float32), comm, layout=layout).shape[1]
        count = len(recurrent.pieces(comm, local, layout=layout))
        counting = _CountingComm(comm)
        offset = np.zeros((count, 1, heads, head_dim, head_dim), np.float32)
        transition = np.zeros_like(offset)
        recurrent.incoming_state(transition, offset, counting, layout=layout)
        forward = counting.received
        recurrent.incoming_state_backward(offset, transition, offset, counting, layout=layout)
        x = np.zeros((1, local, channels), np.float32)
        halo = recurrent.halo(x, 3, counting, layout=layout)
        recurrent.halo_backward(halo, x, 3, counting, layout=layout)
        kv = 2 * (comm.size - 1) * local * heads * head_dim * 2  # a ring's K and V, bf16
        row = {"length": length, "state_forward": forward, "all": counting.received,
               "ring_kv_forward": kv}
        rows.append(row)
        say(f"{length:>8} tokens: recurrent layer {counting.received / 2**20:8.2f} MiB "
            f"(state forward {forward / 2**20:.2f}); ring attention K/V forward "
            f"{kv / 2**20:10.2f} MiB", flush=True)
    write_json(json_path, rows, comm.rank)
    comm.free()


def _delta_inputs(length: int, heads: int, dim: int, generator: torch.Generator) -> List[Any]:
    q, k, v = (torch.randn(1, length, heads, dim, generator=generator) for _ in range(3))
    g = -torch.rand(1, length, heads, generator=generator)
    beta = torch.rand(1, length, heads, generator=generator)
    return [q, k, v, g, beta]


def _ssd_inputs(length: int, heads: int, dim: int, state: int,
                generator: torch.Generator) -> List[Any]:
    x = torch.randn(1, length, heads, dim, generator=generator)
    dt = torch.rand(1, length, heads, generator=generator) * 0.1
    a = -torch.rand(heads, generator=generator)
    b, c = (torch.randn(1, length, 1, state, generator=generator) for _ in range(2))
    return [x, dt, a, b, c]


def _forward_backward(run: Callable[..., torch.Tensor], tensors: List[Any]) -> Callable[[], None]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def call() -> None:
        out = run(*leaves)
        out.backward(torch.ones_like(out))
    return call


@main.command()
@click.option("--length", default=8192, show_default=True, help="Global sequence length.")
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--state", default=64, show_default=True, help="Mamba2's dstate.")
@click.option("--layout", default="contiguous", show_default=True)
@click.option("--threads", default=2, show_default=True,
              help="Threads of the one-process reference (every core).")
@click.option("--repeats", default=3, show_default=True)
@json_option
def mixers(length: int, heads: int, head_dim: int, state: int, layout: str, threads: int,
           repeats: int, json_path: Optional[str]) -> None:
    """Forward + backward of each sharded mixer against transformers'
    chunked function on the whole sequence in one process."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi")
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    torch.set_num_threads(1)
    say(f"bench_recurrent mixers: {comm.size} ranks x 1 thread, {layout}, {length} tokens, "
        f"{heads} heads of {head_dim}; one process: {threads} threads; forward + backward, "
        f"float32, best of {repeats}")
    generator = torch.Generator().manual_seed(0)
    families: Dict[str, Any] = {
        "gated_delta_rule": (_delta_inputs(length, heads, head_dim, generator),
                             lambda *t: torch_chunk_gated_delta_rule(*t)[0],
                             lambda *t: gated_delta_rule(*t, comm, layout=layout)[0]),
        "mamba2_scan": (_ssd_inputs(length, heads, head_dim, state, generator),
                        lambda *t: mamba2_chunk_scan(*t, chunk_size=256),
                        lambda *t: mamba2_scan(*t, comm, layout=layout)),
    }
    rows = []
    for name, (full, alone, sharded) in families.items():
        shards = [t if t.dim() == 1 else shard_sequence(t, comm, layout=layout) for t in full]

        def one_process(alone=alone, full=full) -> float:
            torch.set_num_threads(threads)
            call = _forward_backward(alone, full)
            call()
            best = best_local(call, repeats)
            torch.set_num_threads(1)
            return best
        reference = first_rank_alone(world, one_process)
        call = _forward_backward(sharded, shards)
        call()
        ours = best_slowest(world, call, repeats)
        rows.append({"mixer": name, "sharded_s": ours, "one_process_s": reference})
        say(f"{name}: sharded {ours * 1e3:.1f} ms, one process {reference * 1e3:.1f} ms "
            f"(speedup {reference / ours:.2f}x on {comm.size} ranks)", flush=True)
    _state_against_allgather(world, comm, heads, head_dim, layout, repeats, say, rows)
    write_json(json_path, rows, comm.rank)
    comm.free()


@main.command()
@click.option("--seq", default=4096, show_default=True, help="Global sequence length.")
@click.option("--hidden", default=256, show_default=True)
@click.option("--layers", default=4, show_default=True,
              help="Decoder layers: every fourth full attention, the rest Gated DeltaNet.")
@click.option("--threads", default=2, show_default=True,
              help="Threads of the one-process reference (every core).")
@click.option("--repeats", default=2, show_default=True)
@json_option
def train(seq: int, hidden: int, layers: int, threads: int, repeats: int,
          json_path: Optional[str]) -> None:
    """A Qwen3-Next-shaped model's training step (forward, backward, the
    gradients summed over ranks): commlib_ring attention and
    recurrent_parallel on every rank against the model with sdpa and
    transformers' torch mixers on the whole sequence in one process."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from commlib.bindings import transformers as cht

    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi")
    cht.register(comm)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    torch.set_num_threads(1)
    heads = hidden // 64
    config = Qwen3NextConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=64, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                  for i in range(layers)],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden, linear_num_key_heads=heads,
        linear_num_value_heads=2 * heads, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=seq, use_cache=False)
    data = torch.randint(1024, (1, seq), generator=torch.Generator().manual_seed(1))

    def model_with(implementation: str):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                experts_implementation="eager")

    def one_process() -> float:
        torch.set_num_threads(threads)
        model = model_with("sdpa")

        def step() -> None:
            model(input_ids=data, labels=data).loss.backward()
        step()
        best = best_local(step, repeats)
        torch.set_num_threads(1)
        return best
    reference = first_rank_alone(world, one_process)
    model = cht.recurrent_parallel(model_with("commlib_ring"), comm)
    shard = cht.shard_batch({"input_ids": data}, comm, attn_implementation=model)

    def sharded() -> None:
        model(**shard).loss.backward()
        cht.allreduce_gradients(model, comm)
    sharded()
    ours = best_slowest(world, sharded, repeats)
    say(f"bench_recurrent train: Qwen3-Next-shaped, {layers} layers (hidden {hidden}), "
        f"{seq} tokens: {comm.size} ranks x 1 thread {ours:.2f} s per step, one process x "
        f"{threads} threads {reference:.2f} s (speedup {reference / ours:.2f}x)")
    write_json(json_path, [{"seq": seq, "sharded_s": ours, "one_process_s": reference}],
               comm.rank)
    comm.free()


def _state_against_allgather(world, comm, heads: int, head_dim: int, layout: str, repeats: int,
                             say, rows: List[dict]) -> None:
    """``incoming_state`` (matrix transitions) against ``Allgather`` of the
    bytes it gathers: the agreement and the scan are its overhead."""
    count = len(recurrent.pieces(comm, 64, layout=layout))
    offset = torch.randn(count, 1, heads, head_dim, head_dim)
    transition = torch.randn(count, 1, heads, head_dim, head_dim) / head_dim
    pairs = np.zeros(2 * offset.numel(), np.float32)
    gathered = np.empty(comm.size * pairs.size, np.float32)
    ours = best_slowest(world, lambda: recurrent.incoming_state(transition, offset, comm,
                                                                layout=layout), repeats * 5)
    bare = best_slowest(world, lambda: world.Allgather(pairs, gathered), repeats * 5)
    rows.append({"call": "incoming_state", "us": ours * 1e6, "allgather_us": bare * 1e6})
    say(f"incoming_state ({heads} x {head_dim} x {head_dim} float32 a piece, {count} "
        f"piece(s) a rank): {ours * 1e6:.0f} us; bare Allgather {bare * 1e6:.0f} us "
        f"({ours / bare:.2f}x, {math.prod(offset.shape) * 8 / 2**20:.2f} MiB a rank)")


if __name__ == "__main__":
    main()
