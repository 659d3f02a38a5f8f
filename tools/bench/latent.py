"""Multi-head latent attention (DeepSeek-V3's MLA) on this machine: the
latent path (``latent_ring_attention``: the latent and rotary key travel,
each block expanded where it arrives) against the expanded-head ring
(today's path for a model that expands first: K and V of every head
travel) and against one process attending the whole sequence on the same
cores, all in one launch.

    mpiexec -n 2 python -m commlib.tools.bench.latent bytes train

- bytes: what the ring's forward sends per token per layer, counted at the
  communicator, at DeepSeek-V3's sizes (128 heads, q/k 192 = 128 + 64 rope,
  v 128, latent 512 + 64): latent against expanded, and the KV cache's
  bytes per token per layer per rank, latent (absorbed decode's) against
  expanded heads.
- train: one MLA layer's attention forward and backward (torch autograd,
  float32, causal zigzag) at ``--seq`` tokens: the latent ring, the
  expanded ring (the expansion of its own shard included), and rank 0
  alone on the whole sequence (expansion and PyTorch SDPA) while the other
  ranks sleep. DeepSeek-V3's head sizes and latent, with ``--heads`` heads
  (128 in the model; fewer to fit a CPU's time).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib.bindings import torch as ct
from commlib.ring import shard_sequence
from commlib.tools.bench.timing import (
    first_rank_alone,
    interleaved,
    json_option,
    slowest,
    write_json,
)

# DeepSeek-V3 (config.json): 128 heads, qk_nope 128 + qk_rope 64, v 128, kv_lora_rank 512
NOPE, ROPE, VALUE, RANK, HEADS = 128, 64, 128, 512, 128


def _inputs(length: int, heads: int, seed: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(1, length, heads, NOPE + ROPE, generator=gen),
            "latent": torch.randn(1, length, RANK, generator=gen),
            "rope_k": torch.randn(1, length, ROPE, generator=gen),
            "w_uk": torch.randn(RANK, heads, NOPE, generator=gen) / RANK ** 0.5,
            "w_uv": torch.randn(RANK, heads, VALUE, generator=gen) / RANK ** 0.5}


def _expanded(x: Dict[str, torch.Tensor]):
    """K and V of every head, as a model that expands before attention has them."""
    k_nope = torch.einsum("bsr,rhn->bshn", x["latent"], x["w_uk"])
    rope = x["rope_k"][:, :, None].expand(-1, -1, k_nope.shape[2], -1)
    return torch.cat([k_nope, rope], dim=-1), torch.einsum("bsr,rhv->bshv", x["latent"],
                                                            x["w_uv"])


def _bytes_per_token(comm, call: Callable[[], object], local: int) -> float:
    """Bytes a token's block carries per token on each of the ring's P - 1
    hops: what this rank's ring shifts sent during ``call()`` over
    (P - 1) x its ``local`` tokens."""
    sent: List[int] = []
    shift = comm.ring_shift_async

    def counting(x, *args, **kwargs):
        sent.append(int(np.prod(x.shape)) * x.element_size())
        return shift(x, *args, **kwargs)
    comm.ring_shift_async = counting
    try:
        call()
    finally:
        del comm.ring_shift_async
    return sum(sent) / ((comm.size - 1) * local)


def bytes_rows(comm, world, local: int) -> List[dict]:
    """The ring forward's bytes per token per layer at DeepSeek-V3's sizes,
    each rank holding ``local`` tokens."""
    x = _inputs(local, HEADS, comm.rank)
    k, v = _expanded(x)
    with torch.no_grad():
        latent = _bytes_per_token(comm, lambda: ct.latent_ring_attention(
            x["q"], x["latent"], x["rope_k"], x["w_uk"], x["w_uv"], comm, layout="zigzag",
            causal=True, method="ring"), local)
        expanded = _bytes_per_token(comm, lambda: ct.ring_attention(
            x["q"], k, v, comm, layout="zigzag", causal=True, method="ring"), local)
    element = 4  # float32 here; the ratio is the dtype's to the dtype's
    cache_latent, cache_expanded = (RANK + ROPE) * element, HEADS * (NOPE + ROPE + VALUE) * element
    return [{"test": "bytes", "ranks": comm.size, "tokens": local * comm.size,
             "latent_bytes_per_token": latent, "expanded_bytes_per_token": expanded,
             "ratio": expanded / latent,
             "cache_latent_bytes_per_token": cache_latent,
             "cache_expanded_bytes_per_token": cache_expanded,
             "cache_ratio": cache_expanded / cache_latent}]


def train_rows(comm, world, seq: int, heads: int, iters: int) -> List[dict]:
    """Forward and backward of one layer's attention: latent ring, expanded
    ring, one process."""
    full = _inputs(seq, heads, seed=0)
    mine = {name: (shard_sequence(t, comm, layout="zigzag") if name in ("q", "latent", "rope_k")
                   else t).clone().requires_grad_() for name, t in full.items()}
    scale = (NOPE + ROPE) ** -0.5

    def latent_ring():
        out = ct.latent_ring_attention(mine["q"], mine["latent"], mine["rope_k"], mine["w_uk"],
                                       mine["w_uv"], comm, layout="zigzag", causal=True,
                                       softmax_scale=scale, method="ring")
        out.sum().backward()

    def expanded_ring():
        k, v = _expanded(mine)
        out = ct.ring_attention(mine["q"], k, v, comm, layout="zigzag", causal=True,
                                softmax_scale=scale, method="ring")
        out.sum().backward()

    whole = {name: t.clone().requires_grad_() for name, t in full.items()}

    def one_process():  # every core's thread, the other ranks asleep
        torch.set_num_threads(comm.size)
        k, v = _expanded(whole)
        out = torch.nn.functional.scaled_dot_product_attention(
            whole["q"].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            scale=scale)
        out.sum().backward()
        torch.set_num_threads(1)

    times = interleaved(world, {"latent": latent_ring, "expanded": expanded_ring}, iters)
    alone = min(first_rank_alone(world, lambda: slowest(MPI.COMM_SELF, one_process))
                for _ in range(iters))
    latent, expanded = min(times["latent"]), min(times["expanded"])
    return [{"test": "train", "ranks": comm.size, "seq": seq, "heads": heads,
             "t_latent_s": latent, "t_expanded_s": expanded, "t_one_process_s": alone,
             "expanded_over_latent": expanded / latent, "one_process_over_latent": alone / latent}]


def describe(row: dict) -> str:
    if row["test"] == "bytes":
        return (f"bytes    {row['ranks']} ranks, DeepSeek-V3 sizes: the ring sends "
                f"{row['latent_bytes_per_token']:.0f} B a token a layer (latent) against "
                f"{row['expanded_bytes_per_token']:.0f} (expanded heads): "
                f"{row['ratio']:.1f}x fewer (target >= 30); KV cache "
                f"{row['cache_latent_bytes_per_token']} against "
                f"{row['cache_expanded_bytes_per_token']} B a token a layer: "
                f"{row['cache_ratio']:.1f}x")
    return (f"train    {row['ranks']} ranks, {row['seq']} tokens, {row['heads']} heads: latent "
            f"ring {row['t_latent_s']:.2f} s, expanded ring {row['t_expanded_s']:.2f} s "
            f"({row['expanded_over_latent']:.2f}x the latent's; target >= 1), one process "
            f"{row['t_one_process_s']:.2f} s ({row['one_process_over_latent']:.2f}x)")


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(["bytes", "train"]))
@click.option("--seq", "seqs", default="8192", show_default=True,
              help="Global sequence lengths for train, comma-separated.")
@click.option("--heads", default=8, show_default=True,
              help="Heads for train (DeepSeek-V3: 128).")
@click.option("--iters", default=2, show_default=True)
@json_option
def main(tests, seqs: str, heads: int, iters: int, json_path: Optional[str]) -> None:
    comm = commlib.init()
    world = comm.mpi_comm
    torch.set_num_threads(1)
    rows: List[dict] = []
    for test in tests or ("bytes", "train"):
        if test == "bytes":
            rows += bytes_rows(comm, world, 64)
        else:
            for seq in (int(s) for s in seqs.split(",")):
                rows += train_rows(comm, world, seq, heads, iters)
    if comm.rank == 0:
        for row in rows:
            click.echo(describe(row))
    write_json(json_path, rows, comm.rank)


if __name__ == "__main__":
    main()
