"""Expert parallelism in transformers MoE models (``expert_parallel``,
experts implementation ``"commlib_ep"``) against the unsharded model.

Data parallel plus expert parallel: each rank holds its own batch rows, the
router runs on them unchanged, and the tokens visit the ranks that own their
experts. The reference is the same model, unsharded, with transformers'
eager experts, run by every rank on the concatenation of all ranks' rows.
Each rank's loss is scaled by 1/P, so that the losses sum to the global mean.
The router's load-balancing loss is off (``output_router_logits=False``, the
default of both families): it is a function of the batch's global routing
statistics, which no rank sees; expert parallelism does not change it (the
router is untouched), plain data parallelism already does.
"""

import copy

import numpy as np
import pytest

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")

from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssExperts  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import (  # noqa: E402
    NemotronHConfig,
    NemotronHExperts,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from commlib.bindings.transformers._experts import (  # noqa: E402
    EXPERT_PARALLEL,
    IMPLEMENTATION,
    expert_parallel,
    register_experts,
)
from commlib.bindings.transformers._gradients import allreduce_gradients  # noqa: E402

# experts over 2 ranks, and two nodes of 2
WORLD_SIZES = (2, 4)

try:  # the first experts with a post-expert norm came after transformers 5.17
    from transformers.models.muse_spark.modeling_muse_spark import (
        MuseSparkExperts,
        MuseSparkTextConfig,
    )
except ImportError:
    MuseSparkExperts = MuseSparkTextConfig = None

EXPERTS = 12  # divides 1, 2, 3 and 4 ranks
VOCAB, ROWS_PER_RANK, SEQ = 96, 2, 8
TOLERANCE = 1e-5  # of each tensor's largest reference magnitude

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                 max_position_embeddings=64, initializer_range=0.1,
                 num_experts_per_tok=2, output_router_logits=False)
FAMILIES = {
    "qwen3_moe": lambda experts: transformers.Qwen3MoeConfig(
        **TINY, num_experts=experts, moe_intermediate_size=24, intermediate_size=48,
        norm_topk_prob=True),
    "mixtral": lambda experts: transformers.MixtralConfig(
        **TINY, num_local_experts=experts, intermediate_size=24, router_jitter_noise=0.0),
}


def causal_lm(family: str, experts: int = EXPERTS, dtype=torch.float32):
    """The family's model, seed-identical on every rank, eager experts."""
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        FAMILIES[family](experts), attn_implementation="sdpa", experts_implementation="eager",
        dtype=dtype)


def close(mine: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = reference.abs().max().item()
    return (mine - reference).abs().max().item() <= TOLERANCE * scale


def local_slice(comm, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a full [E, ...] tensor."""
    local = tensor.shape[0] // comm.size
    return tensor[comm.rank * local:(comm.rank + 1) * local]


def storage_bytes(model) -> int:
    """Bytes of the storages behind the parameters: a slice that is a view
    of the full tensor would still count in full."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    return sum(storages.values())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, comm):
    """One training step of the reference and of the expert-parallel copy."""
    reference = causal_lm(request.param)
    model = expert_parallel(copy.deepcopy(reference), comm)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS_PER_RANK * comm.size, SEQ), generator=gen)
    mine = tokens[comm.rank * ROWS_PER_RANK:(comm.rank + 1) * ROWS_PER_RANK]
    reference_loss = reference(input_ids=tokens, labels=tokens).loss
    reference_loss.backward()
    loss = model(input_ids=mine, labels=mine).loss / comm.size
    loss.backward()
    allreduce_gradients(model, comm)
    global_loss = comm.allreduce(np.array([loss.item()]))[0]
    return reference, model, reference_loss.item(), global_loss


def test_loss_matches_the_unsharded_model(trained):
    _, _, reference_loss, global_loss = trained
    assert all_ranks(abs(global_loss - reference_loss) <= TOLERANCE * abs(reference_loss))


def test_every_gradient_matches_the_unsharded_model(comm, trained):
    """Expert weights on this rank's slice, replicated parameters (the
    router among them: the routing weights carry its gradient) summed."""
    reference, model, _, _ = trained
    mismatched = mismatched_gradients(comm, reference, model)
    routers = [p.grad for name, p in reference.named_parameters()
               if name.endswith("mlp.gate.weight")]
    assert all_ranks(not mismatched), mismatched
    assert all_ranks(len(routers) == 2 and all(g.abs().max() > 0 for g in routers))


def mismatched_gradients(comm, reference, model) -> list:
    """Names of the parameters whose gradient differs from the reference's
    (this rank's slice for expert weights)."""
    expected = dict(reference.named_parameters())
    mismatched = []
    for name, parameter in model.named_parameters():
        wanted = expected[name].grad
        if getattr(parameter, EXPERT_PARALLEL, False):
            wanted = local_slice(comm, wanted)
        if parameter.grad is None or not close(parameter.grad, wanted):
            mismatched.append(name)
    return mismatched


@pytest.mark.parametrize("attn", ["commlib_ring", "commlib_hybrid"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_context_and_expert_parallel_together(comm, family, attn):
    """One sequence sharded over the ranks (Ring, or the hybrid) and the
    experts split over the same ranks: loss and every gradient as the
    unsharded model's on the whole sequence."""
    from commlib.bindings import transformers as cht

    cht.register(comm)
    reference = causal_lm(family)
    model = expert_parallel(copy.deepcopy(reference), comm)
    model.set_attn_implementation(attn)
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    reference_loss = reference(input_ids=tokens, labels=tokens).loss
    reference_loss.backward()
    loss = model(**cht.shard_batch({"input_ids": tokens}, comm, attn_implementation=model)).loss
    loss.backward()
    allreduce_gradients(model, comm)
    global_loss = comm.allreduce(np.array([loss.item()]))[0]
    mismatched = mismatched_gradients(comm, reference, model)
    assert all_ranks(abs(global_loss - reference_loss.item()) <= TOLERANCE * reference_loss.item()
                     and not mismatched), mismatched


def test_only_expert_weights_are_split(comm, trained):
    reference, model, _, _ = trained
    expected = dict(reference.named_parameters())
    split = {name for name, p in model.named_parameters() if getattr(p, EXPERT_PARALLEL, False)}
    layers = TINY["num_hidden_layers"]
    names = {f"model.layers.{i}.mlp.experts.{w}" for i in range(layers)
             for w in ("gate_up_proj", "down_proj")}
    shapes = all(p.shape == local_slice(comm, expected[name]).shape
                 and torch.equal(p.detach(), local_slice(comm, expected[name]).detach())
                 for name, p in model.named_parameters() if name in split)
    assert all_ranks(split == names and shapes), sorted(split)


def test_parameter_memory_drops_by_the_expert_share(comm, trained):
    reference, model, _, _ = trained
    experts = sum(p.nbytes for p in model.parameters() if getattr(p, EXPERT_PARALLEL, False))
    replicated = storage_bytes(reference) - experts * comm.size
    assert all_ranks(storage_bytes(model) == replicated + experts)


def seeded_experts(experts_class, config):
    """A bare experts module with seed-identical random weights."""
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    module = experts_class(config)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return module


FEATURES = {  # experts classes whose flags the full models above do not exercise
    "transposed-bias-interleaved": lambda: seeded_experts(GptOssExperts, GptOssConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=EXPERTS)),
    "no-gate": lambda: seeded_experts(NemotronHExperts, NemotronHConfig(
        hidden_size=16, moe_intermediate_size=8, n_routed_experts=EXPERTS)),
    "post-expert-norm": lambda: seeded_experts(MuseSparkExperts, MuseSparkTextConfig(
        moe_hidden_size=16, moe_intermediate_size=8, num_local_experts=EXPERTS)),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_experts_features_match_the_eager_forward(comm, feature):
    """Outputs and every gradient of one experts module (is_transposed,
    has_bias, a custom ``_apply_gate``, has_gate=False, post-expert norm)."""
    if feature == "post-expert-norm" and MuseSparkExperts is None:
        pytest.skip(f"transformers {transformers.__version__} has no post-expert norm")
    reference = FEATURES[feature]()
    module = expert_parallel(copy.deepcopy(reference), comm)
    assert_matches_the_eager_forward(comm, reference, module)


def test_a_flag_that_transformers_does_not_set_means_its_default(comm):
    """transformers 5.17 sets no ``has_post_expert_norm`` (the feature came
    later): commlib_ep reads it as the decorator's default, no norm, instead
    of refusing the module."""
    reference = qwen_experts()
    module = copy.deepcopy(reference)
    if hasattr(module, "has_post_expert_norm"):
        del module.has_post_expert_norm
    expert_parallel(module, comm)
    assert_matches_the_eager_forward(comm, reference, module)


def assert_matches_the_eager_forward(comm, reference, module):
    """The expert-parallel ``module`` against the unsharded ``reference``
    run on every rank's tokens: outputs, input and routing-weight gradients,
    and each parameter's gradient (this rank's slice for expert weights)."""
    tokens, width = 6, reference.down_proj.shape[2 if reference.is_transposed else 1]
    gen = torch.Generator().manual_seed(2)
    count = tokens * comm.size
    x = torch.randn(count, width, generator=gen, requires_grad=True)
    index = torch.rand(count, EXPERTS, generator=gen).topk(2).indices
    weights = torch.rand(count, 2, generator=gen, requires_grad=True)
    probe = torch.randn(count, width, generator=gen)
    out = reference(x, index, weights)
    (out * probe).sum().backward()
    rows = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    x_mine, weights_mine = (t.detach()[rows].requires_grad_() for t in (x, weights))
    out_mine = module(x_mine, index[rows], weights_mine)
    (out_mine * probe[rows]).sum().backward()
    allreduce_gradients(module, comm)
    ok = close(out_mine, out[rows]) and close(x_mine.grad, x.grad[rows]) \
        and close(weights_mine.grad, weights.grad[rows])
    expected = dict(reference.named_parameters())
    for name, parameter in module.named_parameters():
        wanted = expected[name].grad
        ok = ok and close(parameter.grad, local_slice(comm, wanted)
                          if getattr(parameter, EXPERT_PARALLEL, False) else wanted)
    assert all_ranks(ok)


def qwen_experts(experts: int = EXPERTS):
    """A bare Qwen3-MoE experts module: the cheapest thing to refuse."""
    return seeded_experts(Qwen3MoeExperts, FAMILIES["qwen3_moe"](experts))


def test_an_expert_count_the_world_size_does_not_divide_is_refused(comm):
    if comm.size == 1:
        pytest.skip("every expert count divides one rank")
    model = causal_lm("qwen3_moe", experts=2 * comm.size + 1)
    full = [p.shape for p in model.parameters()]
    raises_everywhere(ValueError, lambda: expert_parallel(model, comm), match="does not divide")
    assert all_ranks(full == [p.shape for p in model.parameters()])


def transformers_expert_parallel(comm):
    module = qwen_experts()
    module._is_expert_parallel = True
    return module


def quantization_scales(comm):
    module = qwen_experts()
    module.down_proj_scale = torch.nn.Parameter(torch.ones(EXPERTS, 1, 1))
    return module


REFUSED = {  # the reason, as the error names it: the model that has it
    "transformers' own expert parallelism": transformers_expert_parallel,
    "called twice": lambda comm: expert_parallel(qwen_experts(), comm),
    "no experts module": lambda comm: torch.nn.Linear(4, 4),
    "down_proj_scale": quantization_scales,
}


@pytest.mark.parametrize("reason", sorted(REFUSED))
def test_what_commlib_ep_cannot_compute_is_refused_by_name(comm, reason):
    model = REFUSED[reason](comm)
    raises_everywhere(ValueError, lambda: expert_parallel(model, comm), match=reason)


def test_selecting_commlib_ep_by_name_alone_is_refused(comm):
    register_experts()
    module = qwen_experts()
    module.config._experts_implementation = IMPLEMENTATION
    index = torch.zeros(3, 2, dtype=torch.int64)
    raises_everywhere(RuntimeError, lambda: module(torch.zeros(3, 32), index, torch.ones(3, 2)),
                      match="expert_parallel(model, comm)")
