"""transformers encoders over commlib (issue 53): BERT, RoBERTa, ModernBERT
(a global layer, and a local one whose window is shorter than the
sequence or covers it) and EuroBERT, with masked-LM and
sequence-classification heads, sharded by commlib_ring and
commlib_ulysses, give the unsharded model's loss and gradients (sdpa, one
process, the same global batch, float64); what a shard would get wrong is
refused on every rank."""

import copy

import numpy as np
import pytest

import requires
from conftest import raises_everywhere

transformers = requires.module("transformers")
torch = requires.module("torch")
hf = requires.module("commlib.bindings.transformers")

WORLD_SIZES = (2, 3)

SEQ, BATCH, VOCAB = 21, 2, 64  # 2P divides 21 at no world size: every layout pads
TOL = 1e-10  # float64 against float64
# ModernBERT's and EuroBERT's own masked-LM loss is transformers' ForMaskedLMLoss, which
# computes in float32 (its logits.float() rounds a float64 model's); commlib's in float64
FLOAT32_LOSS = 1e-6
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "bert": lambda: transformers.BertConfig(**TINY, **NO_DROPOUT, pad_token_id=0),
    # RoBERTa numbers positions from pad_token_id + 1 and skips pad tokens (one in the batch)
    "roberta": lambda: transformers.RobertaConfig(**TINY, **NO_DROPOUT, pad_token_id=1),
    # layer 0 global, layer 1 local: a window of 4 tokens each side, shorter than SEQ
    "modernbert": lambda: transformers.ModernBertConfig(
        **TINY, **SPECIAL, cls_token_id=1, sep_token_id=2, local_attention=8,
        global_attn_every_n_layers=2),
    # the local window (32 each side) covers the sequence: no window
    "modernbert-mean": lambda: transformers.ModernBertConfig(
        **TINY, **SPECIAL, cls_token_id=1, sep_token_id=2, local_attention=64,
        global_attn_every_n_layers=2, classifier_pooling="mean"),
    "eurobert": lambda: transformers.EuroBertConfig(
        **TINY, **SPECIAL, mask_token_id=3, num_key_value_heads=2, classifier_pooling="bos"),
    "eurobert-mean": lambda: transformers.EuroBertConfig(
        **TINY, **SPECIAL, mask_token_id=3, num_key_value_heads=2, classifier_pooling="mean"),
    "eurobert-late": lambda: transformers.EuroBertConfig(
        **TINY, **SPECIAL, mask_token_id=3, num_key_value_heads=2, classifier_pooling="late"),
}
HEADS = {"masked": transformers.AutoModelForMaskedLM,
         "classification": transformers.AutoModelForSequenceClassification,
         "tokens": transformers.AutoModelForTokenClassification}
IMPLEMENTATIONS = ("commlib_ring", "commlib_ulysses")
# the quick tier: each family, each head, each implementation and both ModernBERT windows once
QUICK = {("bert", "masked", "commlib_ring"), ("roberta", "classification", "commlib_ulysses"),
         ("modernbert", "classification", "commlib_ring"),
         ("modernbert-mean", "masked", "commlib_ulysses"),
         ("eurobert-late", "classification", "commlib_ring")}
CASES = [pytest.param(family, head, implementation,
                      marks=() if (family, head, implementation) in QUICK else pytest.mark.full)
         for family in FAMILIES for head in ("masked", "classification")
         for implementation in IMPLEMENTATIONS]


def global_batch(head):
    """The same batch on every rank. Masked-LM labels on four tokens only,
    all in the first quarter of the sequence: at 3 ranks one rank holds
    none (BERT's own loss there would be NaN); RoBERTa's pad token at 6
    shifts the positions after it."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=gen)
    input_ids[1, 6] = 1
    if head == "classification":
        return {"input_ids": input_ids, "labels": torch.tensor([1, 0])}
    labels = torch.full_like(input_ids, -100)
    labels[0, :3], labels[1, 5] = input_ids[0, :3], input_ids[1, 5]
    if head == "tokens":
        labels = torch.where(labels == -100, -100, labels % 2)
    return {"input_ids": input_ids, "labels": labels}


def pair(family, head, implementation):
    """The unsharded model (sdpa) and a copy attending with
    ``implementation``, float64."""
    torch.manual_seed(0)
    reference = HEADS[head].from_config(FAMILIES[family](), attn_implementation="sdpa",
                                        dtype=torch.float64)
    model = HEADS[head].from_config(copy.deepcopy(reference.config),
                                    attn_implementation=implementation, dtype=torch.float64)
    model.load_state_dict(reference.state_dict())
    return reference, model


def world_sum(comm, value):
    return float(comm.allreduce(np.array([float(value.detach())]))[0])


def assert_close(got, want, tol, what):
    """Within ``tol`` of the reference's largest entry (a gradient that is
    zero in exact arithmetic, as a key bias's, is rounding on both sides)."""
    got, want = (torch.as_tensor(x, dtype=torch.float64).detach() for x in (got, want))
    error = float((got - want).abs().max())
    assert error <= tol * max(float(want.abs().max()), 1e-6), f"{what}: off by {error:.2e}"


def check_against_unsharded(comm, family, head, implementation, batch=None):
    hf.register(comm)
    reference, model = pair(family, head, implementation)
    batch = batch or global_batch(head)
    want = reference(**batch).loss
    want.backward()
    shard = hf.shard_batch(batch, comm, attn_implementation=model)
    loss = model(**shard).loss
    loss.backward()
    hf.allreduce_gradients(model, comm)
    tol = FLOAT32_LOSS if head == "masked" and family.split("-")[0] in ("modernbert",
                                                                         "eurobert") else TOL
    assert_close(world_sum(comm, loss), want, tol, "loss summed over the ranks")
    for (name, got), (_, expected) in zip(model.named_parameters(),
                                          reference.named_parameters()):
        assert (got.grad is None) == (expected.grad is None), name
        if expected.grad is not None:
            assert_close(got.grad, expected.grad, tol, name)


@pytest.mark.parametrize("family, head, implementation", CASES)
def test_loss_and_gradients_equal_the_unsharded_model(comm, family, head, implementation):
    check_against_unsharded(comm, family, head, implementation)


@pytest.mark.full
@pytest.mark.parametrize("implementation", ["commlib_hybrid", "commlib_ring_docs"])
def test_the_other_implementations_too(comm, implementation):
    check_against_unsharded(comm, "modernbert", "masked", implementation)
    check_against_unsharded(comm, "bert", "classification", implementation)


@pytest.mark.full
def test_token_classification_is_per_token_like_masked_lm(comm):
    check_against_unsharded(comm, "bert", "tokens", "commlib_ring")


@pytest.mark.full
def test_token_type_ids_are_sharded(comm):
    batch = global_batch("classification")
    batch["token_type_ids"] = (torch.arange(SEQ) >= 9).long().expand(BATCH, SEQ)
    check_against_unsharded(comm, "bert", "classification", "commlib_ulysses", batch)


# ---- refused, on every rank -------------------------------------------------------------------
def sharded(comm, family, head, implementation="commlib_ring", batch=None, model=None):
    hf.register(comm)
    model = model or pair(family, head, implementation)[1]
    return model, hf.shard_batch(batch or global_batch(head), comm, attn_implementation=model)


def test_a_head_whose_loss_reads_the_whole_sequence_is_refused(comm):
    hf.register(comm)
    model = transformers.BertForQuestionAnswering(FAMILIES["bert"]()).double()
    model.set_attn_implementation("commlib_ring")
    raises_everywhere(ValueError, lambda: hf.shard_batch(global_batch("masked"), comm,
                                                         attn_implementation=model),
                      match="a ForQuestionAnswering head")


def test_a_pooling_commlib_does_not_know_is_refused(comm):
    """Llama's classifier pools the last token; BERT's pre-training head
    pools (its pooler) without being a classifier: the probe finds it."""
    hf.register(comm)
    torch.manual_seed(0)
    llama = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        **TINY, num_key_value_heads=2, pad_token_id=0))
    llama.set_attn_implementation("commlib_ring")
    raises_everywhere(ValueError, lambda: hf.shard_batch(global_batch("classification"), comm,
                                                         attn_implementation=llama),
                      match="LlamaForSequenceClassification pools the sequence")
    pretraining = transformers.BertForPreTraining(FAMILIES["bert"]())
    pretraining.set_attn_implementation("commlib_ring")
    raises_everywhere(ValueError, lambda: hf.shard_batch({"input_ids": global_batch(
        "masked")["input_ids"]}, comm, attn_implementation=pretraining),
        match="bert.pooler (BertPooler)")


def test_packed_documents_are_refused_for_a_pooled_head(comm):
    batch = global_batch("classification")
    batch["position_ids"] = torch.cat([torch.arange(9), torch.arange(SEQ - 9)]).expand(BATCH, SEQ)
    raises_everywhere(ValueError, lambda: sharded(comm, "bert", "classification", batch=batch),
                      match="pooled as one")


def test_a_pooled_head_refuses_a_batch_shard_batch_did_not_make(comm):
    model, shard = sharded(comm, "modernbert", "classification")
    raises_everywhere(ValueError, lambda: model(input_ids=shard["input_ids"].clone(),
                                                position_ids=shard["position_ids"]),
                      match="make the batch with shard_batch")


def test_masked_lm_labels_without_their_global_count_are_refused(comm):
    model, shard = sharded(comm, "bert", "masked")
    raises_everywhere(ValueError, lambda: model(
        **{**shard, "labels": shard["labels"].clone(), "num_items_in_batch": None}),
        match="without num_items_in_batch")


def test_cross_attention_is_refused(comm):
    """BERT's cross-attention reads an encoder's states the probe never
    sees (it runs on tokens alone): its attention layer was not checked."""
    hf.register(comm)
    config = FAMILIES["bert"]()
    config.is_decoder = config.add_cross_attention = True
    torch.manual_seed(0)
    model = transformers.BertLMHeadModel(config)
    model.set_attn_implementation("commlib_ring")
    shard = hf.shard_batch({"input_ids": global_batch("masked")["input_ids"]}, comm,
                           attn_implementation=model)
    raises_everywhere(ValueError, lambda: model(**shard,
                                                encoder_hidden_states=torch.zeros(BATCH, 5, 32)),
                      match="this model was not checked")


def test_a_bidirectional_window_transformers_draws_two_ways_is_refused(comm):
    """ModernBERT's local layers pass their half window + 1, where
    transformers' sdpa mask and flash-attention agree; a model passing the
    half window itself gets |q - k| <= W from one and < W from the other."""
    model = pair("modernbert", "masked", "commlib_ring")[1]
    for module in model.modules():
        if getattr(module, "sliding_window", None) is not None:
            module.sliding_window -= 1
    _, shard = sharded(comm, "modernbert", "masked", model=model)
    raises_everywhere(ValueError, lambda: model(**shard),
                      match="does not implement this bidirectional sliding window")
