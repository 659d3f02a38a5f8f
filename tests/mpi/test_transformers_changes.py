"""transformers over commlib: a shard reaching a model that changed after
``shard_batch`` checked it (a hook, a swapped class, another attention
implementation) is refused on every rank, naming the change; labels given
the way an unsharded script gives them (the shard's labels or input ids,
without ``shift_labels``) train exactly as the unsharded model, and any
other labels without ``shift_labels`` are refused."""

import copy

import numpy as np
import pytest

import commlib

import requires
from conftest import all_ranks, raises_everywhere

transformers = requires.module("transformers")
torch = requires.module("torch")
hf = requires.module("commlib.bindings.transformers")

# 3: the zigzag shards' edges move, and a rank holds the sequence's middle
WORLD_SIZES = (2, 3)

SEQ, VOCAB, TOL = 24, 128, 1e-10
LOSS_TOL = 1e-6  # transformers' causal-LM loss computes in float32, whatever the logits


def config():
    return transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB,
                                    max_position_embeddings=2 * SEQ, attention_dropout=0.0)


def global_batch():
    gen = torch.Generator().manual_seed(3)
    return {"input_ids": torch.randint(0, VOCAB, (2, SEQ), generator=gen)}


@pytest.fixture(scope="module")
def reference(comm):
    """The unsharded model (sdpa, float64): its loss and gradients with
    the input ids as labels."""
    hf.register(comm)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa",
                                                          dtype=torch.float64)
    initial = copy.deepcopy(model)
    ids = global_batch()["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return {"model": initial, "loss": loss.item(),
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def sharded(reference, implementation="commlib_ring"):
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(reference["model"].config), attn_implementation=implementation,
        dtype=torch.float64)
    model.load_state_dict(reference["model"].state_dict())
    return model


def matches(comm, model, reference, loss):
    """The ranks' losses sum to the unsharded loss, and their summed
    gradients to its gradients."""
    loss.backward()
    hf.allreduce_gradients(model, comm)
    total = float(comm.allreduce(np.array([loss.item()]))[0])
    ok = abs(total - reference["loss"]) <= LOSS_TOL * abs(reference["loss"])
    for name, parameter in model.named_parameters():
        want = reference["grads"][name]
        ok = ok and float((parameter.grad - want).abs().max()) <= TOL * max(
            float(want.abs().max()), 1e-3)
    return all_ranks(ok)


# how an unsharded script passes labels: each is completed with the shard's shift_labels
LABELS = {"the shard's labels": lambda shard: shard["labels"],
          "the shard's input_ids": lambda shard: shard["input_ids"]}


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("labels", LABELS)
def test_labels_without_shift_labels_are_completed(comm, reference, labels):
    """``model(input_ids=..., labels=...)`` on a shard, no ``shift_labels``
    nor ``num_items_in_batch``: the unsharded model's loss and gradients
    (transformers alone would shift inside each shard and average per rank)."""
    model = sharded(reference)
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    loss = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                 cu_seq_lens_q=shard["cu_seq_lens_q"], cu_seq_lens_k=shard["cu_seq_lens_k"],
                 labels=LABELS[labels](shard)).loss
    assert matches(comm, model, reference, loss)


def test_other_labels_without_shift_labels_are_refused(comm, reference):
    """Labels the shard did not come with (a copy of its input ids) would be
    shifted inside each shard: refused on every rank."""
    model = sharded(reference)
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: model(input_ids=shard["input_ids"],
                                    position_ids=shard["position_ids"],
                                    labels=shard["input_ids"].clone()),
                      match="labels given without shift_labels")


class _Mixes(torch.nn.Module):
    """A stand-in for a module class swapped in: its output reads the
    previous token."""

    def forward(self, x):
        return x + x.roll(1, dims=1)


def _forward_hook(model):
    model.model.layers[0].mlp.register_forward_hook(
        lambda module, args, output: output + output.roll(1, dims=1))


def _pre_hook(model):
    model.model.layers[1].mlp.register_forward_pre_hook(
        lambda module, args: (args[0].cumsum(dim=1),))


def _class_swap(model):
    model.model.layers[1].mlp.__class__ = type("MixingMLP", (_Mixes,), {})


CHANGES = {"a forward hook": (_forward_hook, "a forward hook was added"),
           "a forward pre-hook": (_pre_hook, "a forward pre-hook was added"),
           "a class swap": (_class_swap, "its class is now MixingMLP")}


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("change", CHANGES)
def test_a_change_after_shard_batch_is_refused(comm, reference, change):
    """A module changed after the check so that it mixes tokens: the next
    forward of a shard names the change, on every rank, and the next
    ``shard_batch`` probes again and refuses the mixing module."""
    model = sharded(reference)
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    apply, named = CHANGES[change]
    apply(model)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**shard), match=named)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: hf.shard_batch(global_batch(), comm, attn_implementation=model),
                      match="mix tokens along the sequence")


def test_a_token_local_hook_is_accepted_once_checked_again(comm, reference):
    """A hook that mixes nothing, added after the check: refused until
    ``shard_batch`` checks the model again, then exact."""
    model = sharded(reference)
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: output * 1.0)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**shard),
                      match="call shard_batch(batch, comm, attn_implementation=model) again")
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    assert matches(comm, model, reference, model(**shard).loss)


def test_another_attention_implementation_is_refused(comm, reference):
    """``set_attn_implementation("sdpa")`` after ``shard_batch``: no commlib
    layer would run, each rank attending within its shard. Refused at the
    forward, naming both implementations; set back, exact."""
    model = sharded(reference)
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=model)
    model.set_attn_implementation("sdpa")
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**shard),
                      match="its attention implementation is now 'sdpa' (it was 'commlib_ring')")
    model.set_attn_implementation("commlib_ring")
    assert matches(comm, model, reference, model(**shard).loss)
