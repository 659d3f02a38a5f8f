"""Decode-sized attention calls against what they cannot avoid: their
transfers (the raw mpi4py calls of the same bytes) plus their kernels (the
same torch SDPA calls on the same blocks), in one launch, interleaved, the
slowest rank, the median (issue 46). Each line also gives the call's
framework operations (``tools/bench/ops.py``).

    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.small_calls

- ``decode attention``: one new token's attention over this rank's shard of
  the KV cache (``--cached`` positions per rank) and the lse merge
  (``bindings.torch.decode_attention``), against SDPA over the shard with
  its mask plus one ``Allgather`` of the (out, lse) bytes.
- ``seq_to_head``: a [1, --tokens, heads, dim] shard to heads
  (``bindings.torch.seq_to_head``), against one ``Alltoall`` of its bytes
  plus the two layout copies (into rank-major chunks and out of them).
- ``ring_attention``: --tokens per rank, contiguous, non-causal
  (``bindings.torch.ring_attention``), against P - 1 ``Sendrecv`` of the
  K and V block plus P SDPA calls of the local queries on a block.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib.bindings import torch as ct
from commlib.tools.bench.ops import warm_torch_ops
from commlib.tools.bench.timing import interleaved, json_option, repeated, write_json


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """The kernel the calls run: [b, s, h, d] in, SDPA over [b, h, s, d]."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)


def decode_attention(comm, world: MPI.Comm, cached: int, heads: int, dim: int) -> Dict:
    """(call, floor) of one decode step over a sharded cache."""
    g = torch.Generator().manual_seed(comm.rank)
    q = torch.randn(1, 1, heads, dim, generator=g)
    k, v = (torch.randn(1, cached, heads, dim, generator=g) for _ in range(2))
    mine = torch.arange(cached) + comm.rank * cached
    now = torch.tensor([comm.size * cached])
    packed = np.zeros(heads * (dim + 1) * 4 + 8, np.uint8)
    gathered = np.empty(comm.size * packed.size, np.uint8)
    mask = torch.ones(1, 1, 1, cached, dtype=torch.bool)

    def floor() -> None:
        _sdpa(q, k, v, mask)
        world.Allgather(packed, gathered)
    return {"call": lambda: ct.decode_attention(q, k, v, comm, q_positions=now,
                                                 k_positions=mine, causal=True),
            "floor": floor}


def seq_to_head(comm, world: MPI.Comm, tokens: int, heads: int, dim: int) -> Dict:
    """(call, floor) of one sequence-to-heads relayout."""
    x = torch.randn(1, tokens, heads, dim)
    size = comm.size
    received = torch.empty(size, 1, tokens, heads // size, dim)

    def floor() -> None:
        chunks = x.view(1, tokens, size, heads // size, dim).permute(2, 0, 1, 3, 4).contiguous()
        world.Alltoall(_bytes(chunks), received.view(torch.uint8).numpy())
        received.permute(1, 0, 2, 3, 4).reshape(1, size * tokens, heads // size, dim)
    return {"call": lambda: ct.seq_to_head(x, comm), "floor": floor}


def ring_attention(comm, world: MPI.Comm, tokens: int, heads: int, dim: int) -> Dict:
    """(call, floor) of one ring attention forward."""
    q, k, v = (torch.randn(1, tokens, heads, dim) for _ in range(3))
    block = torch.cat([k, v]).contiguous()
    incoming = torch.empty_like(block)
    size, rank = comm.size, comm.rank

    def floor() -> None:
        for _ in range(size - 1):
            world.Sendrecv(_bytes(block), (rank + 1) % size,
                           recvbuf=incoming.view(torch.uint8).numpy(),
                           source=(rank - 1) % size)
        for _ in range(size):
            _sdpa(q, k, v)
    return {"call": lambda: ct.ring_attention(q, k, v, comm, layout="contiguous",
                                              causal=False),
            "floor": floor}


@click.command()
@click.option("--cached", default=4096, show_default=True,
              help="KV positions per rank for the decode step.")
@click.option("--tokens", default=64, show_default=True,
              help="Tokens per rank for seq_to_head and ring_attention.")
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--repeat", default=20, show_default=True, help="Calls per timed unit.")
@click.option("--iters", default=9, show_default=True)
@json_option
def main(cached: int, tokens: int, heads: int, head_dim: int, repeat: int, iters: int,
         json_path: Optional[str]) -> None:
    """Decode-sized attention calls against their transfers plus kernels."""
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"bench small_calls: {comm.size} ranks, torch float32 on the CPU, {heads} heads of "
        f"{head_dim}; microseconds per call, slowest rank; floor = transfers + kernels")
    made: Dict[str, Callable[[], Dict]] = {
        f"decode attention ({cached} cached)": functools.partial(
            decode_attention, comm, raw, cached, heads, head_dim),
        f"seq_to_head ({tokens} tokens)": functools.partial(
            seq_to_head, comm, raw, tokens, heads, head_dim),
        f"ring_attention ({tokens} tokens)": functools.partial(
            ring_attention, comm, raw, tokens, heads, head_dim)}
    rows: List[dict] = []
    for name, make in made.items():
        pair = make()
        ops = world.allreduce(warm_torch_ops(pair["call"]), op=MPI.MAX)
        times = interleaved(world, {kind: repeated(call, repeat) for kind, call in pair.items()},
                            iters)
        call, floor = (float(np.median(times[kind])) / repeat * 1e6 for kind in ("call", "floor"))
        rows.append({"call": name, "us": call, "floor_us": floor, "ratio": call / floor,
                     "aten_ops": ops})
        say(f"{name:>32}: {call:8.1f} us, floor {floor:8.1f} us ({call / floor:.2f}x), "
            f"{ops} aten ops", flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()


if __name__ == "__main__":
    main()
