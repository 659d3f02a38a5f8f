"""The probe that finds which layers of a transformers model mix tokens
along the sequence (bindings/transformers/_token_mixers.py), in one process:
each family's mixers found by running the model, whatever their names; a
made-up mixer, a hand-written attention and an attention that mixes beside
its attention call found too; the model left as it was; the answer kept
until the model changes."""

import pytest

import requires

torch = requires.module("torch")
transformers = requires.module("transformers")

from transformers import AttentionInterface  # noqa: E402

from commlib.bindings.transformers._token_mixers import (  # noqa: E402
    PROBE_LENGTH,
    probed,
    token_mixers,
)

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, intermediate_size=48, max_position_embeddings=64)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)
# family -> (config, the mixers the probe must find: (name, class, kind))
FAMILIES = {
    "llama": (lambda: transformers.LlamaConfig(**TINY),
              {("model.layers.0.self_attn", "LlamaAttention", "attention"),
               ("model.layers.1.self_attn", "LlamaAttention", "attention")}),
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(**TINY, num_experts=4,
                                                      num_experts_per_tok=2,
                                                      moe_intermediate_size=16),
                  {("model.layers.0.self_attn", "Qwen3MoeAttention", "attention"),
                   ("model.layers.1.self_attn", "Qwen3MoeAttention", "attention")}),
    "lfm2": (lambda: transformers.Lfm2Config(**TINY, layer_types=["conv", "full_attention"],
                                             conv_L_cache=3),
             {("model.layers.0.conv", "Lfm2ShortConv", "unknown"),
              ("model.layers.1.self_attn", "Lfm2Attention", "attention")}),
    "bamba": (lambda: transformers.BambaConfig(**TINY, attn_layer_indices=[1], **MAMBA2),
              {("model.layers.0.mamba", "BambaMixer", "unknown"),
               ("model.layers.1.self_attn", "BambaAttention", "attention")}),
    "attention-free bamba": (
        lambda: transformers.BambaConfig(**TINY, attn_layer_indices=[], **MAMBA2),
        {("model.layers.0.mamba", "BambaMixer", "unknown"),
         ("model.layers.1.mamba", "BambaMixer", "unknown")}),
    "falcon_mamba": (
        lambda: transformers.FalconMambaConfig(hidden_size=32, num_hidden_layers=2,
                                               vocab_size=96, state_size=8, conv_kernel=4),
        {("backbone.layers.0.mixer", "FalconMambaMixer", "unknown"),
         ("backbone.layers.1.mixer", "FalconMambaMixer", "unknown")}),
}


def tiny(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def found(model, parallel=lambda module: False):
    return {(m.name, type(m.module).__name__, m.kind)
            for m in token_mixers(model, parallel=parallel)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_mixers_are_found_by_running_it(family):
    make, want = FAMILIES[family]
    assert found(tiny(make())) == want


class CumulativeMean(torch.nn.Module):
    """A made-up mixer: each token adds the mean of the tokens before it
    (no convolution, no parameter a list of names could know)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, hidden_states):
        steps = torch.arange(1, hidden_states.shape[1] + 1)[None, :, None]
        return self.inner(hidden_states + hidden_states.cumsum(1) / steps)


class ByHand(torch.nn.Module):
    """An attention computed in its own code, never through transformers'
    attention interface (so never commlib's)."""

    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def forward(self, hidden_states, **kwargs):
        scores = hidden_states @ hidden_states.transpose(1, 2)
        return scores.softmax(-1) @ self.attention.o_proj(hidden_states), None


def test_a_made_up_mixer_is_found_and_blamed_alone():
    model = tiny(FAMILIES["llama"][0]())
    model.model.layers[1].mlp = CumulativeMean(model.model.layers[1].mlp)
    assert ("model.layers.1.mlp", "CumulativeMean", "unknown") in found(model)
    assert {name for name, _, kind in found(model) if kind == "unknown"} == {"model.layers.1.mlp"}


def test_an_attention_by_hand_is_unknown():
    model = tiny(FAMILIES["llama"][0]())
    model.model.layers[0].self_attn = ByHand(model.model.layers[0].self_attn)
    assert found(model) >= {("model.layers.0.self_attn", "ByHand", "unknown"),
                            ("model.layers.1.self_attn", "LlamaAttention", "attention")}


def test_an_attention_that_mixes_beside_its_attention_call_is_unknown():
    """A layer that attends through the interface and also shifts its input
    by one token: the attention as the identity still leaves it mixing."""
    model = tiny(FAMILIES["llama"][0]())
    attention = model.model.layers[0].self_attn
    own = type(attention).forward

    def shifted(self, hidden_states, *args, **kwargs):
        return own(self, torch.roll(hidden_states, 1, dims=1), *args, **kwargs)
    attention.forward = shifted.__get__(attention)
    kinds = {name: kind for name, _, kind in found(model)}
    assert kinds["model.layers.0.self_attn"] == "unknown"
    assert kinds["model.layers.1.self_attn"] == "attention"


def test_a_parallel_module_is_stood_in_for_and_never_run():
    model = tiny(FAMILIES["lfm2"][0]())
    conv = model.model.layers[0].conv
    ran = []
    conv.conv.register_forward_pre_hook(lambda *_: ran.append(1))  # inside its own forward
    mixers = found(model, parallel=lambda module: module is conv)
    assert ("model.layers.0.conv", "Lfm2ShortConv", "parallel") in mixers
    assert not ran and "forward" not in conv.__dict__


def test_the_probe_leaves_the_model_as_it_was():
    model = tiny(FAMILIES["lfm2"][0]())
    model.train()
    mapping = dict(AttentionInterface._global_mapping)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    token_mixers(model, parallel=lambda module: False)
    assert model.training and all(m.training for m in model.modules())
    assert AttentionInterface._global_mapping == mapping
    assert not any(module._forward_hooks or "forward" in module.__dict__
                   for module in model.modules())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_answer_is_kept_until_the_model_changes():
    model = tiny(FAMILIES["llama"][0]())
    first = probed(model, lambda module: False)
    assert probed(model, lambda module: False) is first
    model.model.layers[1].mlp = CumulativeMean(model.model.layers[1].mlp)
    assert "model.layers.1.mlp" in {m.name for m in probed(model, lambda module: False)}


def test_the_probe_length_is_no_size_of_the_tiny_models():
    """The probe finds the sequence axis by its length: it must not be one of
    the other sizes these models have."""
    assert PROBE_LENGTH not in (TINY["hidden_size"], TINY["num_attention_heads"],
                                TINY["num_key_value_heads"], TINY["intermediate_size"],
                                TINY["hidden_size"] // TINY["num_attention_heads"])


def test_a_model_that_cannot_run_on_tokens_alone_is_named():
    """The probe runs the model on tokens; a failure says so (a ValueError,
    which the model check turns into a refusal on every rank)."""
    model = tiny(FAMILIES["llama"][0]())
    model.model.layers[0].mlp.forward = lambda hidden_states: 1 / 0
    with pytest.raises(ValueError, match="runs LlamaForCausalLM once on 13 random tokens"):
        token_mixers(model, parallel=lambda module: False)


class Reads(torch.nn.Module):
    """A made-up mixer around an MLP: ``weight`` times the token ``offset``
    places before each (the first token, when offset is None)."""

    def __init__(self, inner, offset, weight):
        super().__init__()
        self.inner, self.offset, self.weight = inner, offset, weight

    def forward(self, hidden_states):
        if self.offset is None:
            read = hidden_states[:, :1].expand_as(hidden_states)
        else:
            read = torch.roll(hidden_states, self.offset, dims=1)
            read[:, :self.offset] = 0
        return self.inner(hidden_states + self.weight * read)


@pytest.mark.parametrize("offset, weight, dtype", [
    (None, 1.0, torch.float32),     # every token reads the first
    (8, 1.0, torch.float32),        # a dilated read, past the middle
    (1, 0.003, torch.bfloat16),     # a small weight, in 16 bits
])
def test_mixers_far_apart_or_faint_are_found(offset, weight, dtype):
    model = tiny(FAMILIES["llama"][0]()).to(dtype)
    model.model.layers[0].mlp = Reads(model.model.layers[0].mlp, offset, weight)
    assert ("model.layers.0.mlp", "Reads", "unknown") in found(model)


def test_a_bfloat16_model_s_token_local_layers_are_not_mistaken():
    assert found(tiny(FAMILIES["qwen3_moe"][0]()).to(torch.bfloat16)) == \
        FAMILIES["qwen3_moe"][1]
