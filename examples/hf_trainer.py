"""A transformers Trainer script, context-parallel over commlib (and expert-
parallel for MoE models): the lines marked ``# commlib`` are all that
differs from the script a Trainer user already runs.

    mpiexec -n 2 python examples/hf_trainer.py                        # Llama, Ring, packed
    mpiexec -n 4 python examples/hf_trainer.py --cp-size 2            # 2 groups of 2 ranks
    mpiexec -n 2 python examples/hf_trainer.py --model qwen3_moe --attn commlib_ulysses
    mpiexec -n 2 python examples/hf_trainer.py --trl                  # TRL's SFTTrainer
    python examples/hf_trainer.py                                     # one process

Launched by mpiexec, no torchrun and no accelerate config: each rank runs
the Trainer as one process, and commlib owns the ranks (the sequence cut
over each context-parallel group, the global batch split over the groups,
gradients and the logged loss summed over every rank). Rank 0 prints each
logged step and the evaluation: the same numbers, to float32 rounding, at
any number of ranks.
"""

from __future__ import annotations

import click
import torch
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Qwen3MoeConfig,
    Trainer,
    TrainingArguments,
)

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


def documents(count: int, longest: int, seed: int):
    """Token documents of uneven lengths (ids 3..255), their labels the ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(longest // 4, longest + 1, (count,), generator=gen)
    return [{"input_ids": ids, "labels": list(ids)}
            for ids in (torch.randint(3, 256, (int(n),), generator=gen).tolist()
                        for n in lengths)]


def trainer_of(family: str, attn: str, seq: int, steps: int, use_trl: bool, comm):
    """The trainer as its user builds it, on commlib's attention."""
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation=attn)
    if family.endswith("_moe"):
        cht.expert_parallel(model, comm)  # commlib (MoE): each rank keeps its experts
    options = dict(output_dir="/tmp/commlib-hf-trainer", per_device_train_batch_size=4,
                   per_device_eval_batch_size=4, gradient_accumulation_steps=2,
                   max_steps=steps, learning_rate=1e-3, logging_steps=1, report_to=[],
                   save_strategy="no", seed=0, disable_tqdm=True)
    train, evaluation = documents(64, seq, 1), documents(8, seq, 2)
    if not use_trl:
        return Trainer(model=model, args=TrainingArguments(**options), train_dataset=train,
                       eval_dataset=evaluation, data_collator=DataCollatorWithFlattening())
    import datasets
    import trl
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(  # a stand-in for the model's own tokenizer
        tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)},
                                                    unk_token="t2")),
        pad_token="t0", eos_token="t1")
    dataset = datasets.Dataset.from_list([{"input_ids": d["input_ids"]} for d in train])
    config = trl.SFTConfig(**options, packing=True, max_length=seq, bf16=False,
                           dataset_text_field=None)
    return trl.SFTTrainer(model=model, args=config, train_dataset=dataset,
                          processing_class=tokenizer)


@click.command()
@click.option("--model", "family", type=click.Choice(sorted(CONFIGS)), default="llama",
              show_default=True)
@click.option("--attn", type=click.Choice(sorted(cht.LAYOUTS)), default="commlib_ring",
              show_default=True, help="commlib's attention implementation.")
@click.option("--cp-size", type=int, default=None,
              help="Ranks per context-parallel group (default: all).")
@click.option("--seq", default=128, show_default=True, help="Longest document.")
@click.option("--steps", default=10, show_default=True)
@click.option("--trl", "use_trl", is_flag=True, help="TRL's SFTTrainer with packing=True.")
def main(family: str, attn: str, cp_size: int, seq: int, steps: int, use_trl: bool) -> None:
    """Train with the Trainer over commlib; rank 0 prints the logs."""
    comm = commlib.init()                      # commlib
    cht.register(comm)                         # commlib: its attention implementations
    torch.manual_seed(0)
    trainer = trainer_of(family, attn, seq, steps, use_trl, comm)
    cht.prepare_trainer(trainer, comm, cp_size=cp_size)  # commlib: the one change to a trainer
    trainer.train()
    metrics = trainer.evaluate() if not use_trl else {}
    if comm.rank == 0:
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:2d}  loss {entry['loss']:.6f}  "
                      f"grad_norm {entry['grad_norm']:.6f}", flush=True)
        if metrics:
            print(f"eval_loss {metrics['eval_loss']:.6f}", flush=True)
    comm.free()


if __name__ == "__main__":
    main()
