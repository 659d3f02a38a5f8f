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
  float32, causal zigzag) at ``--seq`` tokens: the latent ring (method
  "ring"), ``latent_ring_attention``'s "auto" (the expanded heads on one
  host, the latent across hosts), the expanded ring (the expansion of its
  own shard included), and rank 0 alone on the whole sequence (expansion
  and PyTorch SDPA, V padded to q's head size as transformers' flash path
  does) while the other ranks sleep. DeepSeek-V3's head sizes and latent,
  with ``--heads`` heads (128 in the model; fewer to fit a CPU's time).
- decode: one new token's attention over a ``--cached``-token sharded cache
  (striped by position, as generate leaves it): the absorbed form over each
  rank's latent cache (``latent_decode_attention``) against
  ``decode_attention`` over an expanded-head cache, and rank 0 alone over
  the whole latent cache (DeepSeek-V3's absorbed decode, its einsums, every
  core's thread); with each cache's bytes per rank.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib.bindings import torch as ct
from commlib.inference import decode_attention, latent_decode_attention, latent_keys
from commlib.inference.latent import absorbed_query
from commlib.ring import shard_sequence
from commlib.ring.latent import resolved
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

    def latent_call(method):
        def run():
            out = ct.latent_ring_attention(mine["q"], mine["latent"], mine["rope_k"],
                                           mine["w_uk"], mine["w_uv"], comm, layout="zigzag",
                                           causal=True, softmax_scale=scale, method=method)
            out.sum().backward()
        return run

    def expanded_ring():
        k, v = _expanded(mine)
        out = ct.ring_attention(mine["q"], k, v, comm, layout="zigzag", causal=True,
                                softmax_scale=scale, method="ring")
        out.sum().backward()

    whole = {name: t.clone().requires_grad_() for name, t in full.items()}

    def one_process():  # every core's thread, the other ranks asleep
        torch.set_num_threads(comm.size)
        k, v = _expanded(whole)
        # V padded to q's head size, as transformers' flash path does for MLA: the fused
        # kernel takes one head size (unpadded, SDPA falls back to its math path)
        padded = torch.nn.functional.pad(v, (0, NOPE + ROPE - VALUE))
        out = torch.nn.functional.scaled_dot_product_attention(
            whole["q"].transpose(1, 2), k.transpose(1, 2), padded.transpose(1, 2),
            is_causal=True, scale=scale)[..., :VALUE]
        out.sum().backward()
        torch.set_num_threads(1)

    times = interleaved(world, {"latent": latent_call("ring"), "auto": latent_call("auto"),
                                "expanded": expanded_ring}, iters)
    alone = min(first_rank_alone(world, lambda: slowest(MPI.COMM_SELF, one_process))
                for _ in range(iters))
    latent, auto, expanded = (min(times[name]) for name in ("latent", "auto", "expanded"))
    return [{"test": "train", "ranks": comm.size, "seq": seq, "heads": heads,
             "auto_method": resolved(comm, "auto"), "t_latent_s": latent, "t_auto_s": auto,
             "t_expanded_s": expanded, "t_one_process_s": alone,
             "expanded_over_latent": expanded / latent, "expanded_over_auto": expanded / auto,
             "one_process_over_latent": alone / latent}]


def decode_rows(comm, world, cached: int, heads: int, iters: int) -> List[dict]:
    """One decode step over a sharded cache of ``cached`` tokens: latent
    (absorbed) against expanded heads against one process."""
    full = _inputs(cached + 1, heads, seed=1)
    mine = np.flatnonzero(np.arange(cached) % comm.size == comm.rank)
    latent = latent_keys(full["latent"][:, mine], full["rope_k"][:, mine])
    k, v = _expanded({name: t[:, mine] if name in ("latent", "rope_k") else t
                      for name, t in full.items()})
    q, weights = full["q"][:, cached:], (full["w_uk"], full["w_uv"])
    where = dict(q_positions=[cached], k_positions=mine, causal=True)
    contenders = {"latent": lambda: latent_decode_attention(q, latent, *weights, comm, **where),
                  "expanded": lambda: decode_attention(q, k, v, comm, **where)}
    whole = latent_keys(full["latent"][:, :cached], full["rope_k"][:, :cached])

    def one_process():  # DeepSeek-V3's own absorbed decode (einsums), every core's thread
        torch.set_num_threads(comm.size)
        query = absorbed_query(q, full["w_uk"])
        scores = torch.einsum("bthc,bnc->bthn", query, whole[:, :, 0]) * (NOPE + ROPE) ** -0.5
        out = torch.einsum("bthn,bnr->bthr", scores.softmax(dim=-1), whole[:, :, 0, :RANK])
        torch.einsum("bthr,rhv->bthv", out, full["w_uv"])
        torch.set_num_threads(1)

    with torch.no_grad():
        times = interleaved(world, contenders, iters)
        alone = min(first_rank_alone(world, lambda: slowest(MPI.COMM_SELF, one_process))
                    for _ in range(iters))
    latent_step, expanded_step = min(times["latent"]), min(times["expanded"])
    held_latent = latent.numel() * latent.element_size()
    return [{"test": "decode", "ranks": comm.size, "cached": cached, "heads": heads,
             "t_latent_s": latent_step, "t_expanded_s": expanded_step, "t_one_process_s": alone,
             "expanded_over_latent": expanded_step / latent_step,
             "one_process_over_latent": alone / latent_step,
             "latent_cache_bytes_per_rank": held_latent,
             "expanded_cache_bytes_per_rank": (k.numel() + v.numel()) * k.element_size(),
             "latent_cache_share": held_latent / (whole.numel() * whole.element_size())}]


def describe(row: dict) -> str:
    if row["test"] == "decode":
        return (f"decode   {row['ranks']} ranks, {row['cached']} cached tokens, {row['heads']} "
                f"heads: latent {row['t_latent_s'] * 1e3:.2f} ms, expanded "
                f"{row['t_expanded_s'] * 1e3:.2f} ms ({row['expanded_over_latent']:.2f}x the "
                f"latent's), one process {row['t_one_process_s'] * 1e3:.2f} ms "
                f"({row['one_process_over_latent']:.2f}x); cache per rank "
                f"{row['latent_cache_bytes_per_rank'] / 2**20:.0f} MiB latent against "
                f"{row['expanded_cache_bytes_per_rank'] / 2**20:.0f} MiB expanded, "
                f"{row['latent_cache_share']:.3f} of the whole latent cache")
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
            f"{row['t_one_process_s']:.2f} s ({row['one_process_over_latent']:.2f}x); method "
            f"auto ({row['auto_method']}) {row['t_auto_s']:.2f} s (the expanded ring "
            f"{row['expanded_over_auto']:.2f}x its time)")


@click.command()
@click.argument("tests", nargs=-1, type=click.Choice(["bytes", "train", "decode"]))
@click.option("--seq", "seqs", default="8192", show_default=True,
              help="Global sequence lengths for train, comma-separated.")
@click.option("--heads", default=8, show_default=True,
              help="Heads for train and decode (DeepSeek-V3: 128).")
@click.option("--cached", default=65536, show_default=True,
              help="Tokens in decode's cache, over all ranks.")
@click.option("--iters", default=2, show_default=True)
@json_option
def main(tests, seqs: str, heads: int, cached: int, iters: int,
         json_path: Optional[str]) -> None:
    comm = commlib.init()
    world = comm.mpi_comm
    torch.set_num_threads(1)
    rows: List[dict] = []
    for test in tests or ("bytes", "train", "decode"):
        if test == "bytes":
            rows += bytes_rows(comm, world, 64)
        elif test == "decode":
            rows += decode_rows(comm, world, cached, heads, 10 * iters)
        else:
            for seq in (int(s) for s in seqs.split(",")):
                rows += train_rows(comm, world, seq, heads, iters)
    if comm.rank == 0:
        for row in rows:
            click.echo(describe(row))
    write_json(json_path, rows, comm.rank)


if __name__ == "__main__":
    main()
