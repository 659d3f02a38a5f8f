"""The conformance matrix's model axis: whole transformers models, each
trained one step and generated from, sharded over the ranks, against the same
model unsharded in one process: correct (the global loss, every gradient,
the generated tokens) or refused on every rank, naming the layer. The models:
the families commlib knows (a dense Llama; hybrids made recurrent_parallel:
Bamba, LFM2's short convolutions, an attention-free Bamba), and what it must
refuse (LFM2 and Bamba left unpatched, FalconMamba, whose mixer it does not
implement, a Llama with a made-up token-mixing module)."""

import copy
import warnings

import numpy as np
import pytest

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")
cht = requires.module("commlib.bindings.transformers")
from test_token_mixers import CumulativeMean  # noqa: E402  (the made-up mixer)

# 2 ranks: zigzag's two pieces per rank; 3: a middle rank whose chunks join,
# and lengths (29 tokens) neither 2P nor 3P divides
WORLD_SIZES = (2, 3)

warnings.filterwarnings("ignore", message=".*(attention mask|deprecated|fast path|falling).*")

VOCAB, LENGTH, TOL = 96, 29, 1e-5
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64,
            attention_dropout=0.0, initializer_range=0.1)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)


def with_made_up_mixer(model, comm):
    model.model.layers[1].mlp = CumulativeMean(model.model.layers[1].mlp)
    return model


def parallel(model, comm):
    return cht.recurrent_parallel(model, comm)


# name -> (config, what makes the sharded copy, None if it is right, else the refusal's words)
MODELS = {
    "llama": (lambda: transformers.LlamaConfig(**TINY), None, None),
    "bamba, recurrent_parallel": (
        lambda: transformers.BambaConfig(**TINY, attn_layer_indices=[1], **MAMBA2),
        parallel, None),
    "attention-free bamba, recurrent_parallel": (
        lambda: transformers.BambaConfig(**TINY, attn_layer_indices=[], **MAMBA2),
        parallel, None),
    "lfm2, recurrent_parallel": (
        lambda: transformers.Lfm2Config(**TINY, layer_types=["conv", "full_attention"],
                                        conv_L_cache=3),
        parallel, None),
    "lfm2, unpatched": (
        lambda: transformers.Lfm2Config(**TINY, layer_types=["conv", "full_attention"],
                                        conv_L_cache=3),
        None, "call recurrent_parallel(model, comm)"),
    "attention-free bamba, unpatched": (
        lambda: transformers.BambaConfig(**TINY, attn_layer_indices=[], **MAMBA2),
        None, "call recurrent_parallel(model, comm)"),
    "falcon_mamba": (
        lambda: transformers.FalconMambaConfig(hidden_size=32, num_hidden_layers=2,
                                               vocab_size=VOCAB, state_size=8, conv_kernel=4),
        None, "FalconMambaMixer) mix tokens along the sequence in a way commlib does not"),
    "llama with a made-up mixer": (lambda: transformers.LlamaConfig(**TINY), with_made_up_mixer,
                                   "CumulativeMean) mix tokens along the sequence"),
}
IMPLEMENTATIONS = ("commlib_ring", "commlib_ulysses")  # zigzag, contiguous


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request, comm):
    """The unsharded model (its own attention and mixers) with the made-up
    mixer where it has one, its loss and gradients on one sequence."""
    cht.register(comm)
    make, prepare, _ = MODELS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
    if prepare is with_made_up_mixer:
        with_made_up_mixer(model, comm)
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    initial = copy.deepcopy(model)
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return {"name": request.param, "model": initial, "tokens": tokens, "loss": loss.item(),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def sharded(reference, comm, implementation):
    """A copy of the reference over ``comm``, attending with
    ``implementation`` where it attends."""
    _, prepare, _ = MODELS[reference["name"]]
    model = copy.deepcopy(reference["model"])
    if "falcon_mamba" not in reference["name"]:  # it has no attention to switch
        model.set_attn_implementation(implementation)
    return parallel(model, comm) if prepare is parallel else model


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_training_is_right_or_refused_on_every_rank(comm, reference, implementation):
    refusal = MODELS[reference["name"]][2]
    model = sharded(reference, comm, implementation)
    batch = {"input_ids": reference["tokens"]}
    if refusal is not None:
        raises_everywhere(ValueError, lambda: cht.shard_batch(batch, comm,
                                                              attn_implementation=model),
                          match=refusal)
        return
    loss = model(**cht.shard_batch(batch, comm, attn_implementation=model)).loss
    loss.backward()
    cht.allreduce_gradients(model, comm)
    total = float(comm.allreduce(np.array([loss.item()]))[0])
    worst = max(float((p.grad - reference["grads"][name]).abs().max()
                      / max(float(reference["grads"][name].abs().max()), 1e-6))
                for name, p in model.named_parameters())
    assert all_ranks(abs(total - reference["loss"]) <= TOL * abs(reference["loss"])
                     and worst <= TOL), (total, reference["loss"], worst)


def greedy(model, prompt, new_tokens):
    """Greedy decoding by hand, the whole sequence through the unsharded
    model at every step (transformers 5.25's own generate fails on an
    attention-free Bamba: its cache has no attention layer to size a mask),
    stopping at the end-of-sequence token as generate does (one row)."""
    sequence, end = prompt, model.generation_config.eos_token_id
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=sequence, use_cache=False).logits[:, -1]
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
            if int(sequence[0, -1]) == end:
                break
    return sequence


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_generation_is_right_or_refused_on_every_rank(comm, reference, implementation):
    refusal = MODELS[reference["name"]][2]
    model = sharded(reference, comm, implementation).eval()
    prompt = reference["tokens"][:, :17]
    if refusal is not None:
        raises_everywhere(ValueError, lambda: cht.generate(model, prompt, comm,
                                                           max_new_tokens=4,
                                                           prefill=implementation),
                          match=refusal)
        return
    want = greedy(reference["model"].eval(), prompt, 6)
    got = cht.generate(model, prompt, comm, max_new_tokens=6, do_sample=False,
                       prefill=implementation)
    assert all_ranks(torch.equal(got, want)), (got, want)


def test_a_batch_sharded_for_one_layout_never_runs_in_another(comm):
    """An attention-free model, whose only checks are its mixers': a batch
    cut for the other implementation's layout raises on every rank."""
    make, _, _ = MODELS["attention-free bamba, recurrent_parallel"]
    torch.manual_seed(0)
    ring = transformers.AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
    ring.set_attn_implementation("commlib_ring")
    ulysses = copy.deepcopy(ring)
    ulysses.set_attn_implementation("commlib_ulysses")
    ring, ulysses = parallel(ring, comm), parallel(ulysses, comm)
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(2))
    shard = cht.shard_batch({"input_ids": tokens}, comm, attn_implementation=ring)
    raises_everywhere(ValueError, lambda: ulysses(**shard),
                      match="the batch was sharded for another layout")


# -- beyond token mixers: what else would make a sharded model silently wrong --------------

def llama(**options):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, **options})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                         attn_implementation="commlib_ring")


def one_step_loss(model, comm, tokens):
    return float(comm.allreduce(np.array([model(**cht.shard_batch(
        {"input_ids": tokens}, comm, attn_implementation=model)).loss.item()]))[0])


def test_a_router_loss_each_rank_would_count_alone_is_refused(comm):
    """Mixtral's load-balancing loss (output_router_logits) over each rank's
    tokens, added to each rank's share: refused, in the config and as a
    forward argument."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2,
                                        output_router_logits=True, router_aux_loss_coef=0.1)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation="commlib_ring")
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    raises_everywhere(ValueError, lambda: cht.shard_batch({"input_ids": tokens}, comm,
                                                          attn_implementation=model),
                      match="config.output_router_logits")
    model.config.output_router_logits = False
    shard = cht.shard_batch({"input_ids": tokens}, comm, attn_implementation=model)
    raises_everywhere(ValueError, lambda: model(**shard, output_router_logits=True),
                      match="load-balancing loss")


def test_a_length_dependent_rotary_embedding_is_right_within_its_length_or_refused(comm):
    """Dynamic RoPE picks its frequencies from the largest position it is
    given: right while the sequence stays within max_position_embeddings
    (no rank switches), refused past it."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(4))
    within = llama(max_position_embeddings=LENGTH, rope_parameters=rope)
    want = copy.deepcopy(within)
    want.set_attn_implementation("sdpa")
    reference = float(want(input_ids=tokens, labels=tokens, use_cache=False).loss)
    got = one_step_loss(within, comm, tokens)
    assert all_ranks(abs(got - reference) <= TOL * abs(reference)), (got, reference)
    past = llama(max_position_embeddings=16, rope_parameters=rope)
    raises_everywhere(ValueError, lambda: one_step_loss(past, comm, tokens),
                      match="'dynamic' rotary embedding")


def test_the_attention_refuses_a_model_other_than_the_one_checked(comm):
    """Checked is a property of the model, not of its config: another model
    built from the same config, or the checked one changed since, is
    refused by its attention (also under torch.compile)."""
    config = transformers.LlamaConfig(**TINY)
    torch.manual_seed(0)
    checked = transformers.LlamaForCausalLM(config)
    other = transformers.LlamaForCausalLM(config)
    checked.set_attn_implementation("commlib_ring")
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    shard = cht.shard_batch({"input_ids": tokens}, comm, attn_implementation=checked)
    raises_everywhere(ValueError, lambda: other(**shard), match="was not checked")
    compiled = torch.compile(other, backend="aot_eager")
    raises_everywhere(ValueError, lambda: compiled(**shard), match="was not checked")
    checked(**shard)
    with_made_up_mixer(checked, comm)
    # refused at the model's forward (its shard meets a changed model) before its attention
    raises_everywhere(ValueError, lambda: checked(**shard), match="changed since")


def test_a_probe_that_fails_on_one_rank_is_refused_on_every_rank(comm):
    """Rank 0's model fails inside the probe (out of memory, say): every
    rank raises, none waits for the agreement's deadline."""
    model = llama()
    if comm.rank == 0:
        model.model.layers[0].mlp.forward = lambda hidden_states: 1 / 0
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(6))
    raises_everywhere(ValueError, lambda: cht.shard_batch({"input_ids": tokens}, comm,
                                                          attn_implementation=model),
                      match="ZeroDivisionError")
