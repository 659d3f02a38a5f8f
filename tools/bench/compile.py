"""torch.compile over commlib, and what one commlib call costs at small sizes.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python -m commlib.tools.bench.compile
    mpiexec -n 2 python -m commlib.tools.bench.compile blocks --seq 256 --repeats 5

- blocks: a training step (forward + backward) of a Llama decoder block and
  a Qwen3-MoE decoder block (its experts held by every rank: the
  expert-parallel dispatch does not compile yet, docs/moe.md; transformers'
  grouped_mm experts) with
  ``commlib_ring`` attention, eager against ``torch.compile(fullgraph=True)``
  (inductor), the same block and shard in one launch.
- calls: the per-call time of eager ``ring_attention`` (contiguous, not
  causal) and ``seq_to_head`` at b=1, h=8, d=64, float32 and ``--calls``
  tokens per rank, against what they are made of, in the same process:
  their communication as bare mpi4py (the ring's P-1 Sendrecv of K and V,
  the relayout's Alltoall of the same bytes) and the ring's kernels (torch
  SDPA on each of the P blocks). ``overhead`` = call / (communication +
  kernels): what commlib adds (agreement, planning, merging, copies).

Every time is the slowest rank's, best of ``--repeats`` (each repeat the mean
of enough back-to-back calls to last ~20 ms), after a warm-up.
"""

from __future__ import annotations

import time
from typing import Callable, List

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib.bindings import torch as ct

HEADS, HEAD_DIM = 8, 64


def _timed(call: Callable[[], object], repeats: int) -> float:
    """Seconds per call: the slowest rank's mean over a batch of calls, best
    of ``repeats`` batches."""
    world = MPI.COMM_WORLD
    call()
    start = time.perf_counter()
    call()
    once = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
    count = max(1, int(0.02 / max(once, 1e-6)))
    best = float("inf")
    for _ in range(repeats):
        world.Barrier()
        start = time.perf_counter()
        for _ in range(count):
            call()
        best = min(best, world.allreduce((time.perf_counter() - start) / count, op=MPI.MAX))
    return best


def _block(comm, family: str, hidden: int, seq: int):
    """A seeded decoder block of ``family`` with commlib_ring attention and a
    fwd+bwd step on this rank's ``seq`` tokens."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    from commlib.bindings import transformers as cht
    from commlib.bindings.transformers import LAYOUTS, mark_checked, sharded_batch

    cht.register(comm)
    common = dict(hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  head_dim=hidden // HEADS, vocab_size=128, num_hidden_layers=1,
                  max_position_embeddings=seq * comm.size, attention_dropout=0.0)
    if family == "llama":
        config = transformers.LlamaConfig(**common, intermediate_size=4 * hidden)
        make = LlamaDecoderLayer
    else:
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2,
                                             moe_intermediate_size=hidden,
                                             intermediate_size=4 * hidden)
        make = Qwen3MoeDecoderLayer
    config._attn_implementation = "commlib_ring"
    config._experts_implementation = "grouped_mm"  # traceable (eager loops over experts hit)
    torch.manual_seed(0)
    layer, rope = make(config, 0), LlamaRotaryEmbedding(config)
    mark_checked(layer.self_attn)  # a layer alone: no model for shard_batch to check
    with torch.no_grad():  # a layer alone is not initialised (its experts: torch.empty)
        for parameter in layer.parameters():
            parameter.normal_(std=0.02)
    batch = sharded_batch({"input_ids": torch.zeros(1, seq * comm.size, dtype=torch.long)},
                          comm, layout=LAYOUTS["commlib_ring"])
    documents = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k")}
    position = batch["position_ids"]
    x = torch.randn(1, seq, hidden, generator=torch.Generator().manual_seed(comm.rank),
                    requires_grad=True)

    def forward(x):
        out = layer(x, attention_mask=None, position_ids=position,
                    position_embeddings=rope(x, position), **documents)
        return (out[0] if isinstance(out, tuple) else out).square().mean()
    return layer, x, forward


def _blocks(comm, seq: int, hidden: int, repeats: int) -> List[str]:
    lines = []
    for family in ("llama", "qwen3_moe"):
        layer, x, forward = _block(comm, family, hidden, seq)
        compiled = torch.compile(forward, fullgraph=True)
        times = {}
        start = time.perf_counter()
        compiled(x).backward()  # the first call compiles
        first = comm.allreduce(np.array([time.perf_counter() - start]), op="max")[0]
        for name, function in (("eager", forward), ("compiled", compiled)):
            times[name] = _timed(lambda f=function, x=x: f(x).backward(), repeats)
        lines.append(f"{family} block, {comm.size} ranks x {seq} tokens, hidden {hidden}: "
                     f"eager {times['eager'] * 1e3:.2f} ms, compiled "
                     f"{times['compiled'] * 1e3:.2f} ms per step "
                     f"(compiled/eager {times['compiled'] / times['eager']:.2f}; first "
                     f"compiled call {first:.1f} s)")
        del layer
    return lines


def _calls(comm, seq: int, repeats: int) -> List[str]:
    """ring_attention and seq_to_head at ``seq`` tokens per rank against
    their bare communication and kernels."""
    world, size = MPI.COMM_WORLD, comm.size
    right, left = (comm.rank + 1) % size, (comm.rank - 1) % size
    gen = torch.Generator().manual_seed(comm.rank)
    q, k, v = (torch.randn(1, seq, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    ring = _timed(lambda: ct.ring_attention(q, k, v, comm, layout="contiguous", causal=False),
                  repeats)
    kv_in = [np.empty(k.numel(), np.float32) for _ in range(2)]
    kv_out = [t.numpy().reshape(-1) for t in (k, v)]

    def exchange():
        for _ in range(size - 1):
            for send, recv in zip(kv_out, kv_in):
                world.Sendrecv(send, dest=right, recvbuf=recv, source=left)
    blocks = [t.transpose(1, 2) for t in (q, k, v)]

    def kernels():
        for _ in range(size):
            torch.nn.functional.scaled_dot_product_attention(*blocks)
    sendrecv, sdpa = _timed(exchange, repeats), _timed(kernels, repeats)
    relayout = _timed(lambda: ct.seq_to_head(q, comm), repeats)
    send = q.numpy().reshape(-1)
    recv = np.empty_like(send)
    alltoall = _timed(lambda: world.Alltoall(send, recv), repeats)
    return [f"ring_attention, {seq} tokens per rank: {ring * 1e6:.0f} us; bare Sendrecv "
            f"{sendrecv * 1e6:.0f} us + SDPA {sdpa * 1e6:.0f} us; overhead "
            f"{ring / (sendrecv + sdpa):.2f}x",
            f"seq_to_head, {seq} tokens per rank: {relayout * 1e6:.0f} us; bare Alltoall "
            f"{alltoall * 1e6:.0f} us; overhead {relayout / alltoall:.2f}x"]


@click.command()
@click.argument("parts", nargs=-1, type=click.Choice(["blocks", "calls"]))
@click.option("--seq", default=512, show_default=True, help="Block tokens per rank.")
@click.option("--hidden", default=512, show_default=True, help="Block hidden size.")
@click.option("--calls", "sizes", default="64,128,256,512", show_default=True,
              help="Tokens per rank of the per-call measurements.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--threads", default=1, show_default=True, help="torch threads per rank.")
def main(parts, seq: int, hidden: int, sizes: str, repeats: int, threads: int) -> None:
    """Compiled vs eager blocks; per-call cost against bare MPI and kernels."""
    torch.set_num_threads(threads)
    comm = commlib.init()
    lines = []
    if not parts or "blocks" in parts:
        lines += _blocks(comm, seq, hidden, repeats)
    if not parts or "calls" in parts:
        for tokens in sizes.split(","):
            lines += _calls(comm, int(tokens), repeats)
    if comm.rank == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
