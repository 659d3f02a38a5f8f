"""Train a small transformers model with commlib's context parallelism (and
expert parallelism for MoE) beside the same model trained in one process.

    mpiexec -n 2 python examples/hf_train.py                                  # Llama, Ring
    mpiexec -n 4 python examples/hf_train.py --model qwen3_moe --attn commlib_ulysses
    mpiexec -n 1 python examples/hf_train.py --device cuda --dtype bfloat16   # on a GPU

Every rank builds both models from the same seed. The single-process one
(``sdpa``, the whole sequence) is the reference; the sharded one sees this
rank's shard of the sequence (``shard_batch``), attends over all of it
through commlib, keeps only its experts (``expert_parallel``) and sums the
gradients of replicated parameters (``allreduce_gradients``) before a plain
optimizer step. Rank 0 prints both losses at every step: they agree to
float32 rounding (in bfloat16, to bfloat16's).
"""

from __future__ import annotations

import copy

import click
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import commlib
from commlib.bindings import transformers as cht

CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=4096),
    "qwen3_moe": lambda: Qwen3MoeConfig(vocab_size=256, hidden_size=128,
                                        intermediate_size=256, moe_intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=4096,
                                        output_router_logits=False),
}


@click.command()
@click.option("--model", "family", type=click.Choice(sorted(CONFIGS)), default="llama",
              show_default=True)
@click.option("--attn", type=click.Choice(sorted(cht.LAYOUTS)), default="commlib_ring",
              show_default=True, help="commlib's attention implementation.")
@click.option("--seq", default=256, show_default=True, help="Global sequence length.")
@click.option("--steps", default=20, show_default=True)
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              show_default=True)
def main(family: str, attn: str, seq: int, steps: int, lr: float, device: str,
         dtype: str) -> None:
    """Sharded training next to single-process training, loss by loss."""
    comm = commlib.init()
    cht.register(comm)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="sdpa",
                                                 dtype=getattr(torch, dtype)).to(device)
    sharded = copy.deepcopy(reference)
    sharded.set_attn_implementation(attn)
    if family.endswith("_moe"):
        cht.expert_parallel(sharded, comm)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (reference, sharded)]
    data = torch.randint(CONFIGS[family]().vocab_size, (1, seq),
                         generator=torch.Generator().manual_seed(1)).to(device)  # same everywhere
    for step in range(steps):
        alone = reference(input_ids=data, labels=data).loss
        alone.backward()
        shard = cht.shard_batch({"input_ids": data}, comm, attn_implementation=sharded)
        mine = sharded(**shard).loss  # this rank's share of the global mean
        mine.backward()
        cht.allreduce_gradients(sharded, comm)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        total = float(comm.allreduce(mine.detach().reshape(1))[0])
        if comm.rank == 0:
            print(f"step {step:2d}  loss {total:.6f} on {comm.size} ranks ({attn})  "
                  f"{alone.item():.6f} in one process", flush=True)
    comm.free()


if __name__ == "__main__":
    main()
