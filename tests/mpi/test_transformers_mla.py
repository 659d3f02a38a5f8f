"""transformers' multi-head latent attention models over commlib: tiny
DeepSeek-V3 (MLA, MoE and first_k_dense_replace; Kimi-K2 is this
architecture), DeepSeek-V2, GLM-4-MoE-lite and LongCat-Flash configs, with
v's head size below q's and k's as every released one has it. The ring
runs ``latent_ring_attention`` once a layer: its "auto" moves expanded heads
on one host (here) and the latent between hosts (forced here too: every
case both ways); Ulysses moves the expanded heads (and the layer warns
so); either way loss and
gradients equal the unsharded model's, also with the experts split by
``expert_parallel``; ``generate`` equals ``model.generate`` over two turns."""

import copy
import warnings

import numpy as np
import pytest

from commlib.errors import CollectiveMismatchError

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")
hf = requires.module("commlib.bindings.transformers")
from commlib.bindings.transformers import _attention  # noqa: E402
from commlib.bindings.transformers._experts import EXPERT_PARALLEL  # noqa: E402

WORLD_SIZES = (2, 3)
SEQ, BATCH, VOCAB = 24, 2, 128
TOL = 1e-5  # of each tensor's largest reference magnitude
# DeepSeek-V3's shape of attention, scaled down: q/k 12 + 4, v 8, latent 16 (+4 rope)
MLA = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
           max_position_embeddings=2 * SEQ, q_lora_rank=32, kv_lora_rank=16,
           qk_rope_head_dim=4, qk_nope_head_dim=12, v_head_dim=8, initializer_range=0.1)
MOE = dict(n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **MLA, **MOE, num_hidden_layers=2, intermediate_size=96, first_k_dense_replace=1,
        n_group=1, topk_group=1),
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **MLA, **MOE, num_hidden_layers=2, intermediate_size=96, first_k_dense_replace=1),
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **MLA, **MOE, num_hidden_layers=2, intermediate_size=96, n_group=1, topk_group=1),
    "longcat_flash": lambda: transformers.LongcatFlashConfig(
        **MLA, num_layers=1, head_dim=4, qk_head_dim=16, ffn_hidden_size=96, n_routed_experts=6,
        moe_topk=2,
        expert_ffn_hidden_size=32, zero_expert_num=1),
}
# (implementation, what the ring moves: "auto"'s choice on this one host, or the latent)
IMPLEMENTATIONS = (("commlib_ring", "auto"), ("commlib_ring", "latent"),
                   ("commlib_ulysses", "auto"))


def reference_of(family):
    """The unsharded model (eager), its loss and gradients on the batch."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](),
                                                          attn_implementation="eager")
    initial = copy.deepcopy(model)
    loss = model(**batch()).loss
    loss.backward()
    return {"model": initial, "loss": loss.item(),
            "grads": {name: p.grad.clone() for name, p in model.named_parameters()
                      if p.grad is not None}}


def batch():
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def close(got, want):
    return bool((got - want).abs().max() <= TOL * max(float(want.abs().max()), 1e-3))


@pytest.fixture
def latent_calls(monkeypatch):
    """How many attention calls moved the latent."""
    calls = []
    moving = _attention.latent_ring_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return moving(*args, **kwargs)
    monkeypatch.setattr(_attention, "latent_ring_attention", counted)
    return calls


def sharded_step(comm, model):
    shard = hf.shard_batch(batch(), comm, attn_implementation=model)
    loss = model(**shard).loss
    loss.backward()
    hf.allreduce_gradients(model, comm)
    return float(comm.allreduce(np.array([loss.item()]))[0])


def mismatched(comm, model, want):
    """Names of the parameters whose gradient differs from the reference's
    (this rank's experts' slice where they are split)."""
    wrong = []
    for name, parameter in model.named_parameters():
        wanted = want["grads"].get(name)
        if wanted is None:
            continue
        if getattr(parameter, EXPERT_PARALLEL, False):
            local = wanted.shape[0] // comm.size
            wanted = wanted[comm.rank * local:(comm.rank + 1) * local]
        if parameter.grad is None or not close(parameter.grad, wanted):
            wrong.append(name)
    return wrong


def layers(model):
    return sum(1 for m in model.modules() if _is_mla(m))


def _is_mla(module):
    from commlib.bindings.transformers._latent import is_latent_attention
    return is_latent_attention(module)


@pytest.mark.parametrize("implementation, moves", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_loss_and_gradients_match_the_unsharded_model(comm, family, implementation, moves,
                                                      latent_calls, monkeypatch):
    if moves == "latent":  # as between hosts, where "auto" moves the latent
        from commlib.ring import latent as core
        monkeypatch.setattr(core, "resolved",
                            lambda comm, method: "ring" if method == "auto" else method)
    hf.register(comm)
    want = reference_of(family)
    model = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(want["model"].config), attn_implementation=implementation)
    model.load_state_dict(want["model"].state_dict())
    if implementation == "commlib_ring":
        loss = sharded_step(comm, model)
    else:  # Ulysses splits heads: the layer says it moves them expanded
        with pytest.warns(UserWarning, match="moves them expanded"):
            loss = sharded_step(comm, model)
    wrong = mismatched(comm, model, want)
    moved = len(latent_calls) == (layers(model) if implementation == "commlib_ring" else 0)
    assert all_ranks(abs(loss - want["loss"]) <= TOL * want["loss"] and not wrong and moved), \
        (loss, want["loss"], wrong, len(latent_calls))


@pytest.mark.full
def test_deepseek_v3_with_its_experts_split(comm, latent_calls):
    """The latent around the ring and the experts split over the same ranks
    (``expert_parallel``): loss and every gradient as the unsharded model's."""
    hf.register(comm)
    want = reference_of("deepseek_v3")
    model = hf.expert_parallel(copy.deepcopy(want["model"]), comm)
    model.set_attn_implementation("commlib_ring")
    loss = sharded_step(comm, model)
    wrong = mismatched(comm, model, want)
    split = any(getattr(p, EXPERT_PARALLEL, False) for p in model.parameters())
    assert all_ranks(abs(loss - want["loss"]) <= TOL * want["loss"] and not wrong and split
                     and len(latent_calls) == layers(model)), (loss, want["loss"], wrong)


def cache_of(out):
    """The cache of a generate output (``cache`` in transformers 5.25,
    ``past_key_values`` in 5.17)."""
    return out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values


def latent_only(cache, model):
    """Whether every layer of ``cache`` keeps K alone, [latent, rotary key]
    a token: multi-head latent attention's cache, no expanded head."""
    width = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    return all(cache.values(layer) is None and tuple(cache.keys(layer).shape[2:]) == (1, width)
               for layer in range(cache.num_layers))


@pytest.mark.parametrize("prefill", ["commlib_ring", "commlib_ulysses"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_is_model_generate_over_two_turns(comm, family, prefill):
    """A prompt of odd length, then a second turn over the sharded cache,
    its new tokens a chunk striped over the ranks (each method), then one
    too short to stripe: the tokens of ``model.generate``; every cache
    layer holds the latent only (Ulysses' prefill expands, and says so)."""
    hf.register(comm)
    model = reference_of(family)["model"]
    first = torch.randint(0, VOCAB, (1, 13), generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = hf.generate(model, first, comm, max_new_tokens=4, return_dict_in_generate=True,
                          prefill=prefill)
    expanding = any("moves them expanded" in str(w.message) for w in said)
    same = [torch.equal(out.sequences, model.generate(first, max_new_tokens=4, do_sample=False))]
    cache = cache_of(out)
    for turn, (added, method) in enumerate([(5, "pass_q"), (4, "pass_kv"), (1, "auto")]):
        more = torch.randint(0, VOCAB, (1, added), generator=torch.Generator().manual_seed(turn))
        ids = torch.cat([out.sequences, more], dim=1)
        out = hf.generate(model, ids, comm, max_new_tokens=2, past_key_values=cache,
                          prefill_method=method, return_dict_in_generate=True)
        same.append(torch.equal(out.sequences,
                                model.generate(ids, max_new_tokens=2, do_sample=False)))
    assert all_ranks(all(same) and latent_only(cache, model)
                     and expanding == (prefill == "commlib_ulysses")), (same, expanding)


def test_deepseek_v32_sparse_attention_is_refused_by_name(comm):
    """DeepSeek-V3.2's indexer picks keys across the whole sequence: refused
    at shard_batch, naming the layer, on every rank."""
    hf.register(comm)
    config = transformers.DeepseekV32Config(
        **MLA, **MOE, num_hidden_layers=2, intermediate_size=96, first_k_dense_replace=1,
        n_group=1, topk_group=1, index_topk=8, index_head_dim=8, index_n_heads=2, head_dim=4)
    model = transformers.AutoModelForCausalLM.from_config(config,
                                                          attn_implementation="commlib_ring")
    raises_everywhere(CollectiveMismatchError,
                      lambda: hf.shard_batch(batch(), comm, attn_implementation=model),
                      match="self_attn (DeepseekV32Attention): DeepSeek sparse attention's indexer")


def test_compiled_decode_is_refused_by_name(comm):
    """compile_decode's fixed buffers hold expanded heads: refused for an
    MLA model on every rank, which decodes eagerly over its latent cache."""
    hf.register(comm)
    model = reference_of("deepseek_v3")["model"]
    prompt = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    raises_everywhere(ValueError, lambda: hf.generate(model, prompt, comm, max_new_tokens=2,
                                                      compile_decode=True),
                      match="compile_decode is not implemented for multi-head latent attention")
