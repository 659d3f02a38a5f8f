"""gpt-oss through commlib: its attention sinks (``s_aux``) in commlib's
ring, Ulysses and hybrid attention, its alternating sliding-window and full
layers, its MoE (biased experts, clamped SwiGLU, a biased router) under
``expert_parallel``, and ``generate`` over the sharded cache (decode and a
second turn's chunk with the sinks), against the same model unsharded in
one process with transformers' eager attention and experts: the loss, every
gradient (the sinks' among them), the greedy tokens. MXFP4-quantized experts
(the released checkpoints' kernels) are refused by expert_parallel, by
name."""

import copy
import warnings

import numpy as np
import pytest

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")
cht = requires.module("commlib.bindings.transformers")

# 2 ranks: zigzag's two pieces per rank, the hybrid a ring of Ulysses pairs at
# 4 heads; 3: a length (29) neither 2P nor 3P divides, 4 heads split 2 + 1 + 1
WORLD_SIZES = (2, 3)

warnings.filterwarnings("ignore", message=".*(attention mask|deprecated).*")

VOCAB, LENGTH = 96, 29
# float64 throughout but for what the model itself computes in float32 (the
# loss: its logits are upcast to float32) and what the MoE combine sums in
# float32 (routing weights and sums, by design: docs/moe.md), measured at
# 5e-8 and 3.6e-7; gradients without expert parallelism at 1.3e-15
LOSS_TOL, GRAD_TOL, EXPERT_PARALLEL_TOL = 1e-6, 1e-12, 1e-5
IMPLEMENTATIONS = ("commlib_ring", "commlib_ulysses", "commlib_hybrid")


def config():
    """Two layers, one of each type (a window of 8 < the 29 tokens), six
    experts (2 and 3 ranks divide them), a consistent YaRN rotary embedding."""
    return transformers.GptOssConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, intermediate_size=16, max_position_embeddings=64,
        num_local_experts=6, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
        initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0})


@pytest.fixture(scope="module")
def reference(comm):
    """The unsharded model (eager attention and experts, float64, sinks near
    the scores' log-sum-exp so that they take a real share), its loss and
    gradients on one sequence."""
    cht.register(comm)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config(), dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(1.0, 1.0)
    tokens = torch.randint(6, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    initial = copy.deepcopy(model)
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return {"model": initial, "tokens": tokens, "loss": loss.item(),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def sharded(reference, comm, implementation, experts):
    model = copy.deepcopy(reference["model"])
    model.set_attn_implementation(implementation)
    return cht.expert_parallel(model, comm) if experts else model


def _expected(comm, parameter, full):
    """The reference gradient of ``parameter``: this rank's experts' slice
    of an expert weight's, the whole of any other's."""
    if not getattr(parameter, "_commlib_expert_parallel", False):
        return full
    local = full.shape[0] // comm.size
    return full[comm.rank * local:(comm.rank + 1) * local]


@pytest.mark.parametrize("experts", [False, True], ids=["replicated-experts",
                                                        "expert-parallel"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_loss_and_every_gradient_are_the_unsharded_models(comm, reference, implementation,
                                                           experts):
    model = sharded(reference, comm, implementation, experts)
    batch = cht.shard_batch({"input_ids": reference["tokens"]}, comm, attn_implementation=model)
    loss = model(**batch).loss
    loss.backward()
    cht.allreduce_gradients(model, comm)
    total = float(comm.allreduce(np.array([loss.item()]))[0])
    errors = {}
    for name, parameter in model.named_parameters():
        want = _expected(comm, parameter, reference["grads"][name])
        errors[name] = float((parameter.grad - want).abs().max()
                             / max(float(want.abs().max()), 1e-6))
    worst = max(errors, key=errors.get)
    bound = EXPERT_PARALLEL_TOL if experts else GRAD_TOL
    sinks = [name for name in errors if name.endswith("self_attn.sinks")]
    assert all_ranks(abs(total - reference["loss"]) <= LOSS_TOL * abs(reference["loss"])
                     and errors[worst] <= bound and len(sinks) == 2), (
        total, reference["loss"], worst, errors[worst])


@pytest.mark.parametrize("experts", [False, True], ids=["replicated-experts",
                                                        "expert-parallel"])
@pytest.mark.parametrize("prefill", ["commlib_ring", "commlib_ulysses"])
def test_generate_is_model_generate(comm, reference, prefill, experts):
    """Greedy tokens of a 17-token prompt (prefill sharded, decode over the
    sharded cache), then a second turn whose 6 new tokens prefill as a
    chunk against the cache: model.generate's on one process."""
    model = sharded(reference, comm, prefill, experts).eval()
    unsharded = reference["model"].eval()
    prompt = reference["tokens"][:, :17]
    want = unsharded.generate(prompt, max_new_tokens=6, do_sample=False)
    first = cht.generate(model, prompt, comm, max_new_tokens=6, do_sample=False,
                         prefill=prefill, return_dict_in_generate=True)
    longer = torch.cat([first.sequences, reference["tokens"][:, 17:23]], dim=1)
    want_next = unsharded.generate(longer, max_new_tokens=4, do_sample=False)
    cache = getattr(first, "cache", None) or first.past_key_values
    got_next = cht.generate(model, longer, comm, past_key_values=cache, max_new_tokens=4,
                            do_sample=False)
    assert all_ranks(torch.equal(first.sequences, want) and torch.equal(got_next, want_next)), (
        first.sequences, want, got_next, want_next)


@pytest.mark.full
def test_a_compiled_decode_step_takes_the_sinks(comm, reference, monkeypatch):
    """generate(compile_decode=True): the decode step traced by dynamo over
    the DecodeCache, its attention given the sinks: model.generate's tokens.
    (Expert-parallel: gpt-oss's eager experts loop over the experts a step
    hits, which a whole-graph compile cannot trace; commlib_ep's are
    compiled around. The eager backend: what is checked is the traced
    step's attention, not inductor's code.)"""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(
        *args, **{**kwargs, "backend": "eager"}))
    model = sharded(reference, comm, "commlib_ring", True).eval()
    prompt = reference["tokens"][:, :17]
    want = reference["model"].eval().generate(prompt, max_new_tokens=4, do_sample=False)
    got = cht.generate(model, prompt, comm, max_new_tokens=4, do_sample=False,
                       compile_decode=True)
    assert all_ranks(torch.equal(got, want)), (got, want)


def test_mxfp4_experts_are_refused_by_name(comm):
    """A quantized checkpoint's experts (transformers' Mxfp4GptOssExperts:
    packed FP4 weights, Triton kernels, not an ExpertsInterface class) would
    ignore commlib_ep: expert_parallel refuses them on every rank, naming
    the class, and leaves them whole."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts
    model = torch.nn.Module()
    model.experts = Mxfp4GptOssExperts(config())
    raises_everywhere(ValueError, lambda: cht.expert_parallel(model, comm),
                      match="Mxfp4GptOssExperts holds expert weights but is not an "
                            "ExpertsInterface class")
    assert all_ranks(model.experts.down_proj.shape[0] == 6)
