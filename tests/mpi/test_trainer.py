"""transformers' Trainer and TRL's SFTTrainer over commlib
(``prepare_trainer``): each step's logged loss and gradient norm, the
learning rates, the final weights, ``eval_loss`` and ``predict``'s logits
equal the same Trainer in one process on the same global batches, with
gradient accumulation, packed and padded batches, experts split over the
ranks, data-parallel groups of context-parallel ranks (4 ranks: 2 x 2), and
after resuming from a checkpoint; what it cannot do is refused on every
rank."""

import copy

import numpy as np
import pytest

import commlib

import requires
from conftest import all_ranks, raises_everywhere

transformers = requires.module("transformers")
torch = requires.module("torch")
hf = requires.module("commlib.bindings.transformers")
import commlib.moe as moe  # noqa: E402
from commlib.bindings.transformers._expert_checkpoint import gathered_state_dict  # noqa: E402
from commlib.tools.simulate import zipf_popularity  # noqa: E402

# 3: the zigzag's cuts move; 4: two data-parallel groups of two context-parallel ranks
WORLD_SIZES = (2, 3, 4)


@pytest.fixture(autouse=True)
def trainer_extra():
    """The Trainer needs accelerate (the trainer extra), asked for by each
    test rather than at import: the GPU check collects this file without it."""
    requires.module("accelerate")

VOCAB, STEPS, SAMPLES = 128, 6, 24
LOSS_TOL = 1e-5  # float32, relative: the Trainer logs float32 sums taken in another order


def llama():
    return transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
                                    max_position_embeddings=64, attention_dropout=0.0,
                                    pad_token_id=0)


def qwen3_moe():
    return transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.1,
        num_experts_per_tok=2, output_router_logits=False, num_experts=12,
        moe_intermediate_size=24, intermediate_size=48, norm_topk_prob=True, pad_token_id=0)


def bamba():
    """A recurrent hybrid: a Mamba2 mixer, then attention."""
    return transformers.BambaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, intermediate_size=48,
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, pad_token_id=0)


def samples(lengths):
    """Token ids of the given lengths (ids 1..VOCAB-1: 0 pads), labels equal."""
    gen = torch.Generator().manual_seed(1)
    drawn = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return [{"input_ids": ids, "labels": list(ids)} for ids in drawn]


EVEN = samples([24] * SAMPLES)
# uneven lengths: padded batches, and packed documents
UNEVEN = samples(torch.randint(5, 30, (SAMPLES,), generator=torch.Generator().manual_seed(2)))


def padded(features):
    """Right padding to the batch's longest, labels -100 and mask 0 there
    (what DataCollatorForLanguageModeling(mlm=False) makes)."""
    longest = max(len(f["input_ids"]) for f in features)
    pad = [longest - len(f["input_ids"]) for f in features]
    return {"input_ids": torch.tensor([f["input_ids"] + [0] * p for f, p in zip(features, pad)]),
            "labels": torch.tensor([f["labels"] + [-100] * p for f, p in zip(features, pad)]),
            "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * p
                                            for f, p in zip(features, pad)])}


COLLATORS = {"even": (EVEN, transformers.default_data_collator),
             "packed": (UNEVEN, transformers.DataCollatorWithFlattening()),
             "padded": (UNEVEN, padded)}


def model_for(config, implementation, comm=None, replicas=False):
    """The family's model, the same on every rank; over ``comm``, its experts
    split (``replicas``: a placement with one redundant expert per rank),
    its recurrent mixers made parallel."""
    torch.manual_seed(0)
    options = {"experts_implementation": "eager"} if "moe" in config.model_type else {}
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                          attn_implementation=implementation,
                                                          **options)
    if comm is not None and "moe" in config.model_type:
        placement = moe.rebalance(zipf_popularity(config.num_experts, 1.5, 1), ranks=comm.size,
                                  redundant=comm.size) if replicas else None
        hf.expert_parallel(model, comm, placement=placement)
    if comm is not None and config.model_type == "bamba":
        hf.recurrent_parallel(model, comm)
    return model


def arguments(out, batch, **extra):
    options = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=4,
                   max_steps=STEPS, learning_rate=1e-2, logging_steps=1, report_to=[],
                   save_strategy="no", gradient_accumulation_steps=2, max_grad_norm=0.5,
                   seed=0, disable_tqdm=True,
                   # Adam's update is about lr * sign(grad) even where a gradient is rounding
                   # noise (1e-7 of the largest): its weights drift apart by up to 1e-3 of
                   # their size in 6 steps, summed in another order; SGD's by 1e-6
                   optim="sgd")
    options.update(extra)
    return transformers.TrainingArguments(**options)


def trained(comm, config, collator, cp_size=None, replicas=False, **extra):
    """(logs, eval_loss, logits of predict, weights) of the Trainer in one
    process (``comm`` None) or prepared over ``comm``."""
    data, collate = COLLATORS[collator]
    out = "/tmp/commlib-trainer"
    if comm is None:
        model = model_for(config, "sdpa")
        batch = 2 * (extra.pop("groups", 1))
    else:
        model = model_for(config, "commlib_ring", comm, replicas)
        batch = 2
    trainer = transformers.Trainer(model=model, args=arguments(out, batch, **extra),
                                   train_dataset=data, eval_dataset=data[:6],
                                   data_collator=collate)
    if comm is not None:
        hf.prepare_trainer(trainer, comm, cp_size=cp_size)
    trainer.train()
    logs = [(h["loss"], h["grad_norm"], h["learning_rate"])
            for h in trainer.state.log_history if "loss" in h]
    evaluated = trainer.evaluate()["eval_loss"]
    predicted = trainer.predict(data[:3]).predictions
    weights = gathered_state_dict(model)  # the experts whole, as one process holds them
    return logs, evaluated, predicted, weights


def close(got, want, tol=LOSS_TOL):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return bool(np.abs(got - want).max() <= tol * max(np.abs(want).max(), 1e-3))


def mismatches(got, want, padding=None):
    """What differs from the one-process run: every logged step, eval_loss,
    predict's logits (where ``padding``, a mask of predict's batch, is
    not 0) and the weights; an empty list on every rank when nothing."""
    (logs, evaluated, predicted, weights), (ref_logs, ref_eval, ref_pred, ref_weights) = got, want
    wrong = [] if len(logs) == len(ref_logs) == STEPS else [f"{len(logs)} steps logged"]
    wrong += [f"step {i}: {a} against {b}" for i, (a, b) in enumerate(zip(logs, ref_logs))
              if not close(a, b)]
    wrong += [] if close(evaluated, ref_eval) else [f"eval_loss {evaluated} against {ref_eval}"]
    if padding is not None:
        predicted, ref_pred = predicted[padding], ref_pred[padding]
    wrong += [] if close(predicted, ref_pred) else ["predict's logits"]
    wrong += [name for name, tensor in ref_weights.items()
              if not close(weights[name].numpy(), tensor.numpy())]
    return [] if all_ranks(not wrong) else wrong or ["(on another rank)"]


CASES = [("llama", "even"), ("llama", "packed"), ("llama", "padded"), ("qwen3_moe", "even"),
         ("qwen3_moe", "replicas"), ("bamba", "even")]
CONFIGS = {"llama": llama, "qwen3_moe": qwen3_moe, "bamba": bamba}


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("family, collator", CASES)
def test_trainer_equals_one_process(comm, family, collator):
    """Context-parallel over every rank: the one-process Trainer's steps."""
    hf.register(comm)
    config = CONFIGS[family]()
    replicas = collator == "replicas"  # the experts' placement with replicas, even batches
    collator = "even" if replicas else collator
    data, collate = COLLATORS[collator]
    mask = collate(data[:3]).get("attention_mask")  # a pad's logits are no prediction
    wrong = mismatches(trained(comm, config, collator, replicas=replicas),
                       trained(None, config, collator),
                       None if mask is None else mask.bool().numpy())
    assert not wrong, wrong


@pytest.mark.full
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_data_parallel_groups_of_context_parallel_ranks(comm, family):
    """cp_size = 2 at 4 ranks: two groups, each its half of every global
    batch; the one-process Trainer on batches twice as large."""
    if comm.size != 4:
        pytest.skip("DP 2 x CP 2 needs 4 ranks")
    hf.register(comm)
    config = CONFIGS[family]()
    got = trained(comm, config, "even", cp_size=2)
    hf.register(comm)  # the attention back over every rank, for the tests after
    wrong = mismatches(got, trained(None, config, "even", groups=2))
    assert not wrong, wrong


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_resuming_continues_the_run(comm, family, tmp_path_factory):
    """Checkpoints every 3 steps (experts gathered into one copy, the
    optimizer's state of each rank's own); a new Trainer resumed from
    step 3 logs steps 4-6 as the uninterrupted run did, and the checkpoint
    loads in one process as the unsplit model."""
    hf.register(comm)
    config = CONFIGS[family]()
    out = str(tmp_path_factory.mktemp("run")) if comm.rank == 0 else None
    out = comm.bcast(np.frombuffer(out.encode().ljust(256), np.uint8) if out else
                     np.zeros(256, np.uint8)).tobytes().decode().strip()

    def run(resume=None):
        model = model_for(config, "commlib_ring", comm)
        trainer = transformers.Trainer(
            model=model, args=arguments(out, 2, save_strategy="steps", save_steps=3,
                                        gradient_accumulation_steps=1, optim="adamw_torch"),
            train_dataset=EVEN, data_collator=transformers.default_data_collator)
        hf.prepare_trainer(trainer, comm)
        trainer.train(resume_from_checkpoint=resume)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

    whole, model = run()
    resumed, _ = run(f"{out}/checkpoint-3")
    saved = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/checkpoint-6")
    gathered = gathered_state_dict(model)
    ok = close(resumed[3:], whole[3:], 0.0) and all(
        close(saved.state_dict()[name].numpy(), tensor.numpy(), 0.0)
        for name, tensor in gathered.items() if name in saved.state_dict())
    assert all_ranks(ok)


def refused(comm, make, match, **extra):
    """``prepare_trainer`` of the Trainer ``make`` builds raises on every rank."""
    hf.register(comm)
    trainer = make()
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: hf.prepare_trainer(trainer, comm, **extra), match=match)


def plain_trainer(comm=None, implementation="commlib_ring", **extra):
    return transformers.Trainer(model=model_for(llama(), implementation),
                                args=arguments("/tmp/commlib-trainer", 2, **extra),
                                train_dataset=EVEN,
                                data_collator=transformers.default_data_collator)


def test_what_it_cannot_do_is_refused_on_every_rank(comm):
    """Each by name, with the fix."""
    refused(comm, plain_trainer, "must be a positive int that divides", cp_size=comm.size + 1)
    refused(comm, lambda: plain_trainer(learning_rate=1e-2 * (1 + comm.rank)),
            "TrainingArguments differ between ranks, here learning_rate=")
    refused(comm, lambda: plain_trainer(label_smoothing_factor=0.1), "label_smoothing_factor")
    refused(comm, lambda: plain_trainer(implementation="sdpa"), "is not one of commlib's")
    twice = plain_trainer()
    hf.prepare_trainer(twice, comm)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: hf.prepare_trainer(twice, comm), match="called twice")


def sft_trained(comm, dataset, tokenizer):
    """TRL's SFTTrainer with packing=True (padding-free): its logs and
    weights, in one process (``comm`` None) or prepared over ``comm``."""
    trl = requires.module("trl")
    model = model_for(llama(), "sdpa" if comm is None else "commlib_ring")
    args = trl.SFTConfig(output_dir="/tmp/commlib-trainer", per_device_train_batch_size=4,
                         max_steps=4, learning_rate=1e-2, packing=True, max_length=64,
                         logging_steps=1, report_to=[], save_strategy="no", seed=0,
                         disable_tqdm=True, bf16=False, optim="sgd", dataset_text_field=None)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=dataset,
                             processing_class=tokenizer)
    if comm is not None:
        hf.prepare_trainer(trainer, comm)
    trainer.train()
    logs = [(h["loss"], h["grad_norm"], h["mean_token_accuracy"], h["entropy"])
            for h in trainer.state.log_history if "loss" in h]
    return logs, {name: p.detach().clone() for name, p in model.named_parameters()}


def test_trl_sft_trainer_with_packing_equals_one_process(comm):
    """SFTTrainer(packing=True): its padding-free collator's documents
    (position_ids, cu_seq_lens, seq_idx) are sharded like any other; the
    loss, gradient norm, TRL's entropy and token accuracy (summed over the
    ranks) and the weights equal one process."""
    datasets = requires.module("datasets")
    tokenizers = requires.module("tokenizers")
    hf.register(comm)
    vocabulary = tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(vocabulary), pad_token="t0", eos_token="t1")
    dataset = datasets.Dataset.from_list([{"input_ids": s["input_ids"]} for s in UNEVEN])
    (logs, weights), (ref_logs, ref_weights) = (sft_trained(comm, dataset, tokenizer),
                                                sft_trained(None, dataset, tokenizer))
    # entropy: TRL 1.0 logs the mean of the ranks' means (1.16: over every token), 2e-5 apart
    ok = len(logs) == len(ref_logs) == 4 and all(close(a[:3], b[:3]) and close(a[3], b[3], 1e-4)
                                                 for a, b in zip(logs, ref_logs))
    ok = ok and all(close(weights[name].numpy(), tensor.numpy())
                    for name, tensor in ref_weights.items())
    assert all_ranks(ok), (logs, ref_logs)
