"""Long-context generation with commlib's sharded KV cache against the same
model's ``model.generate`` in one process on the same cores, in one launch.

    mpiexec -n 2 python -m commlib.tools.bench.inference
    mpiexec -n 2 python -m commlib.tools.bench.inference --experts 16 --seq 512

``--experts N``: a Qwen3-MoE-shaped model of N experts (``--top-k`` each)
instead of the Llama, its experts spread over the ranks
(``expert_parallel``): each decode step then runs every layer's decode
attention and MoE dispatch + combine (the fixed-capacity low-latency path,
issue 46).

First rank 0 alone (the other ranks wait without spinning) runs
``model.generate`` with SDPA and ``--threads`` torch threads (all the
cores); then every rank, one thread each, runs
``commlib.bindings.transformers.generate``. Each reports, best of
``--repeats``:

- prefill: the time to the first new token (``max_new_tokens=1``);
- decode: the time per new token after it, from a run of ``--new`` more;
- the KV cache's bytes on each rank against the whole cache in one process;
- the longest context whose KV cache fits a ``--memory-mib`` budget: per
  rank, against one process;
- whether the greedy tokens are the same.
"""

from __future__ import annotations

import copy
from typing import Dict, Optional

import click
import torch
from mpi4py import MPI
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import commlib
from commlib.bindings import transformers as cht
from commlib.tools.bench.timing import best_slowest, first_rank_alone, json_option, write_json


def _model(hidden: int, heads: int, kv_heads: int, layers: int, positions: int,
           experts: int = 0, top_k: int = 2):
    """A tiny Llama, or with ``experts`` a Qwen3-MoE of that many experts."""
    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=positions)
    config = Qwen3MoeConfig(**common, head_dim=hidden // heads, num_experts=experts,
                            num_experts_per_tok=top_k, moe_intermediate_size=hidden) \
        if experts else LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _cache_bytes(cache) -> int:
    """Bytes of K and V in a transformers cache (every layer)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def _alone(model, ids, new: int, threads: int, repeats: int) -> Dict[str, object]:
    """model.generate in this process with ``threads`` threads."""
    torch.set_num_threads(threads)
    single = MPI.COMM_SELF

    def run(count):
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=count, do_sample=False,
                                  return_dict_in_generate=True)
    run(2)  # warm-up
    prefill = best_slowest(single, lambda: run(1), repeats)
    whole = best_slowest(single, lambda: run(1 + new), repeats)
    out = run(1 + new)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return {"prefill_s": prefill, "decode_s_per_token": (whole - prefill) / new,
            "kv_bytes": _cache_bytes(cache), "tokens": out.sequences}


def _sharded(comm, model, ids, new: int, repeats: int) -> Dict[str, object]:
    """commlib's generate on every rank, one thread each."""
    torch.set_num_threads(1)
    world = comm.mpi_comm

    def run(count):
        return cht.generate(model, ids, comm, max_new_tokens=count,
                            return_dict_in_generate=True)
    run(2)
    prefill = best_slowest(world, lambda: run(1), repeats)
    whole = best_slowest(world, lambda: run(1 + new), repeats)
    out = run(1 + new)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return {"prefill_s": prefill, "decode_s_per_token": (whole - prefill) / new,
            "kv_bytes": world.allreduce(cache.nbytes(), op=MPI.MAX),
            "cached_tokens": world.allreduce(cache.tokens, op=MPI.MAX),
            "tokens": out.sequences}


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Prompt tokens.")
@click.option("--new", default=32, show_default=True, help="Decoded tokens timed.")
@click.option("--hidden", default=512, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--layers", default=4, show_default=True)
@click.option("--threads", default=2, show_default=True,
              help="torch threads of the one-process baseline (the launch's cores).")
@click.option("--repeats", default=2, show_default=True)
@click.option("--memory-mib", default=1024, show_default=True,
              help="KV cache budget per process for the longest-context line.")
@click.option("--experts", default=0, show_default=True,
              help="A Qwen3-MoE of this many experts, spread over the ranks (0: a Llama).")
@click.option("--top-k", default=2, show_default=True, help="Experts per token (--experts).")
@json_option
def main(seq: int, new: int, hidden: int, heads: int, kv_heads: int, layers: int,
         threads: int, repeats: int, memory_mib: int, experts: int, top_k: int,
         json_path: Optional[str]) -> None:
    """Prefill, decode per token, KV bytes per rank and the longest context
    under a memory budget: commlib's generate on P ranks vs one process."""
    comm = commlib.init()
    world = comm.mpi_comm
    model = _model(hidden, heads, kv_heads, layers, seq + new + 8, experts, top_k)
    ids = torch.randint(1024, (1, seq), generator=torch.Generator().manual_seed(1))
    baseline = first_rank_alone(world, lambda: _alone(model, ids, new, threads, repeats))
    if experts:
        model = cht.expert_parallel(copy.deepcopy(model), comm)
    sharded = _sharded(comm, model, ids, new, repeats)
    if comm.rank:
        return
    per_token_alone = baseline["kv_bytes"] / (seq + new)
    per_token_rank = sharded["kv_bytes"] / sharded["cached_tokens"]
    budget = memory_mib * 2 ** 20
    result = {
        "world_size": comm.size, "seq": seq, "new": new, "threads_alone": threads,
        "experts": experts, "top_k": top_k,
        "prefill_alone_s": baseline["prefill_s"], "prefill_sharded_s": sharded["prefill_s"],
        "decode_alone_ms": 1e3 * baseline["decode_s_per_token"],
        "decode_sharded_ms": 1e3 * sharded["decode_s_per_token"],
        "kv_bytes_alone": baseline["kv_bytes"], "kv_bytes_per_rank": sharded["kv_bytes"],
        "longest_context_alone": int(budget // per_token_alone),
        "longest_context_sharded": int(budget // per_token_rank * comm.size),
        "same_tokens": bool(torch.equal(baseline["tokens"], sharded["tokens"])),
    }
    click.echo(
        f"# {comm.size} ranks x 1 thread vs 1 process x {threads} threads; "
        f"{f'Qwen3-MoE ({experts} experts, top-{top_k})' if experts else 'Llama'} hidden "
        f"{hidden}, {heads} heads / {kv_heads} kv, {layers} layers; prompt {seq}, "
        f"{new} decoded\n"
        f"prefill (to the first token)  {result['prefill_sharded_s']:.3f} s vs "
        f"{result['prefill_alone_s']:.3f} s alone: "
        f"{result['prefill_sharded_s'] / result['prefill_alone_s']:.2f}x\n"
        f"decode per token              {result['decode_sharded_ms']:.2f} ms vs "
        f"{result['decode_alone_ms']:.2f} ms alone: "
        f"{result['decode_sharded_ms'] / result['decode_alone_ms']:.2f}x\n"
        f"KV cache bytes                {result['kv_bytes_per_rank']} per rank vs "
        f"{result['kv_bytes_alone']} alone: "
        f"{result['kv_bytes_per_rank'] / result['kv_bytes_alone']:.3f}\n"
        f"longest context, {memory_mib} MiB KV  {result['longest_context_sharded']} tokens "
        f"vs {result['longest_context_alone']} alone\n"
        f"same greedy tokens            {result['same_tokens']}")
    write_json(json_path, result, indent=2)


if __name__ == "__main__":
    main()
