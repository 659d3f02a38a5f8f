"""Hybrid models sharded along the sequence (``recurrent_parallel``): a tiny
Qwen3-Next (Gated DeltaNet + full attention, MoE), a tiny Bamba (Mamba2 +
full attention), a tiny Falcon-H1 (both in every layer) and a tiny LFM2 and
LFM2-MoE (a gated short convolution + full attention), sharded in the
contiguous (commlib_ulysses) and zigzag (commlib_ring) layouts, against the
unsharded model (sdpa, transformers' own torch mixers) that every rank runs
itself on the whole batch: the global loss and every parameter's gradient.
Packed documents (crossing rank boundaries) against the documents run one
by one in the unsharded model. Then expert parallelism in the same model,
and what is refused. (LFM2's own forward lets its convolution cross packed
documents; run one by one, as the reference runs them, each starts from
zeros, which is what the sharded convolution computes.)"""

import copy

import numpy as np
import pytest

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")
hf = requires.module("commlib.bindings.transformers")
from commlib.bindings.transformers._batch import sharded_batch  # noqa: E402
from commlib.bindings.transformers._experts import EXPERT_PARALLEL  # noqa: E402

# 2 ranks: zigzag's two pieces per rank; 3: a middle rank whose zigzag chunks
# join into one piece, and a length (41) that neither 2P nor 3P divides; 4: two
# emulated hosts in the full tier (a whole hybrid model across real links)
WORLD_SIZES = (2, 3, 4)

VOCAB, SEQ = 96, 41
DOCUMENTS = (9, 2, 17, 13)  # packed: 41 tokens, documents crossing the shards' edges
TOL = 1e-5  # of each tensor's largest reference magnitude (float32; the mixers' chunking differs)
EXPERTS = 12  # divides 2, 3 and 4 ranks

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, initializer_range=0.1,
            attention_dropout=0.0)
FAMILIES = {
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        **TINY, layer_types=["linear_attention", "full_attention"], intermediate_size=48,
        num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "bamba": lambda: transformers.BambaConfig(
        **{k: v for k, v in TINY.items() if k != "head_dim"}, intermediate_size=48,
        attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8),
    # a parallel hybrid (attention and Mamba2 in every layer), its mixer scaled (mup)
    "falcon_h1": lambda: transformers.FalconH1Config(
        **TINY, intermediate_size=48, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8,
        mamba_rms_norm=True, ssm_in_multiplier=0.5, ssm_multipliers=[1.0, 0.5, 2.0, 1.0, 0.7]),
    # LFM2: a gated short convolution (kernel 4, with a bias) beside attention, no scan
    "lfm2": lambda: transformers.Lfm2Config(
        **{k: v for k, v in TINY.items() if k not in ("head_dim", "attention_dropout")},
        intermediate_size=48, block_auto_adjust_ff_dim=False, conv_L_cache=4, conv_bias=True,
        layer_types=["conv", "full_attention"]),
    # LFM2-MoE: the same convolution (kernel 3), experts in its second layer
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        **{k: v for k, v in TINY.items() if k not in ("head_dim", "attention_dropout")},
        intermediate_size=48, moe_intermediate_size=24, num_experts=EXPERTS,
        num_experts_per_tok=2, num_dense_layers=1, conv_L_cache=3,
        layer_types=["conv", "full_attention"]),
}
IMPLEMENTATIONS = ("commlib_ulysses", "commlib_ring")  # contiguous, zigzag
# each family's mixer in its first decoder layer (the others': "mamba")
MIXERS = {"qwen3_next": "linear_attn", "lfm2": "conv", "lfm2_moe": "conv"}


def tiny_model(family):
    """The family's model, seed-identical on every rank, random decays."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        FAMILIES[family](), attn_implementation="sdpa", experts_implementation="eager",
        dtype=torch.float32)
    with torch.no_grad():  # decays spread from near 0 to near 1
        for name, parameter in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                parameter.uniform_(-2.0, 1.5)
    return model


def one_sequence():
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    labels = tokens.clone()
    labels[0, :4] = -100
    return {"input_ids": tokens, "labels": labels}


def packed():
    gen = torch.Generator().manual_seed(4)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": torch.randint(0, VOCAB, (n,), generator=gen).tolist()}
                    for n in DOCUMENTS])


BATCHES = {"one sequence": one_sequence, "packed": packed}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request, comm):
    """The unsharded model and, per batch, its loss and gradients: on the
    whole sequence, or on each packed document alone over the batch's count
    of predicted tokens."""
    hf.register(comm)
    model = tiny_model(request.param)
    found = {"family": request.param, "model": copy.deepcopy(model)}
    for kind, make in BATCHES.items():
        model.zero_grad()
        batch = make()
        count = int((batch["labels"][:, 1:] != -100).sum())
        offsets = batch["cu_seq_lens_q"].tolist() if "cu_seq_lens_q" in batch else [0, SEQ]
        loss = sum(model(input_ids=batch["input_ids"][:, a:b], labels=batch["labels"][:, a:b],
                         num_items_in_batch=count, use_cache=False).loss
                   for a, b in zip(offsets, offsets[1:]))
        loss.backward()
        found[kind] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return found


def sharded(reference, comm, implementation, experts=False):
    """A copy of the reference made context-parallel (and expert-parallel)."""
    model = copy.deepcopy(reference["model"])
    model.set_attn_implementation(implementation)
    if experts:
        hf.expert_parallel(model, comm)
    return hf.recurrent_parallel(model, comm)


def step_differences(model, comm, implementation, reference, kind):
    """One sharded forward and backward: the global loss's and the largest
    gradient's difference from the reference, relative to its magnitude."""
    shard = hf.shard_batch(BATCHES[kind](), comm, attn_implementation=model)
    loss = model(**shard).loss
    loss.backward()
    hf.allreduce_gradients(model, comm)
    want_loss, want_grads = reference[kind]
    total = float(comm.allreduce(np.array([loss.item()]))[0])
    worst = 0.0
    for name, parameter in model.named_parameters():
        want = want_grads[name]
        if getattr(parameter, EXPERT_PARALLEL, False):
            local = want.shape[0] // comm.size
            want = want[comm.rank * local:(comm.rank + 1) * local]
        assert parameter.grad is not None, name
        worst = max(worst, float((parameter.grad - want).abs().max()
                                 / max(float(want.abs().max()), 1e-6)))
    return abs(total - want_loss) / abs(want_loss), worst


@pytest.mark.parametrize("kind", sorted(BATCHES))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_loss_and_every_gradient_match_the_unsharded_model(comm, reference, implementation,
                                                           kind):
    model = sharded(reference, comm, implementation)
    loss, grads = step_differences(model, comm, implementation, reference, kind)
    assert all_ranks(loss <= TOL and grads <= TOL), (loss, grads)


@pytest.mark.parametrize("reference", ["qwen3_next", "lfm2_moe"], indirect=True)  # experts
def test_expert_parallel_together(comm, reference):
    """Qwen3-Next's and LFM2-MoE's experts split over the ranks that shard
    its sequence."""
    model = sharded(reference, comm, "commlib_ring", experts=True)
    assert all_ranks(any(getattr(p, EXPERT_PARALLEL, False) for p in model.parameters()))
    loss, grads = step_differences(model, comm, "commlib_ring", reference, "packed")
    assert all_ranks(loss <= TOL and grads <= TOL), (loss, grads)


def test_an_unparallel_model_refuses_a_sharded_batch(comm, reference):
    model = copy.deepcopy(reference["model"])
    model.set_attn_implementation("commlib_ring")
    raises_everywhere(ValueError, lambda: hf.shard_batch(one_sequence(), comm,
                                                         attn_implementation=model),
                      match="recurrent_parallel(model, comm)")


def test_a_batch_sharded_by_hand_reaches_the_attention_and_is_refused(comm, reference):
    """A batch cut right but not by shard_batch (so nobody checked the
    model) reaching a model whose recurrent layers were not made parallel:
    its commlib attention refuses a model nobody checked. (Qwen3-Next's first
    layer is recurrent: transformers 5.25's torch fallback refuses the
    batch's documents there first; 5.17's, or flash-linear-attention, runs
    it, and the attention layer after refuses.)"""
    model = copy.deepcopy(reference["model"])
    model.set_attn_implementation("commlib_ring")
    shard = sharded_batch(one_sequence(), comm, layout="zigzag")
    error = raises_everywhere(ValueError, lambda: model(**shard))
    assert all_ranks("was not checked" in str(error)
                     or "can't keep packed sequences apart" in str(error)), str(error)


def test_a_copy_of_a_parallel_model_is_parallel_too(comm, reference):
    """Its mixers share the communicator and read the copy's config."""
    model = copy.deepcopy(sharded(reference, comm, "commlib_ring"))
    shard = hf.shard_batch(one_sequence(), comm, attn_implementation=model)
    loss = model(**shard).loss
    want = reference["one sequence"][0]
    total = float(comm.allreduce(np.array([loss.item()]))[0])
    assert all_ranks(abs(total - want) <= TOL * abs(want)), (total, want)


def test_a_cache_is_refused(comm, reference):
    model = sharded(reference, comm, "commlib_ring")
    shard = hf.shard_batch(one_sequence(), comm, attn_implementation=model)
    raises_everywhere(ValueError, lambda: model(**shard, use_cache=True), match="use_cache=False")


def test_a_module_of_another_shape_is_refused(comm, reference):
    """What a transformers version that reshaped the mixer would look like."""
    model = copy.deepcopy(reference["model"])
    mixer = MIXERS.get(reference["family"], "mamba")
    del model.model.layers[0].get_submodule(mixer).out_proj
    raises_everywhere(ValueError, lambda: hf.recurrent_parallel(model, comm),
                      match="lacks out_proj")


def test_an_unsupported_family_is_refused(comm):
    config = transformers.Mamba2Config(hidden_size=16, num_hidden_layers=1, num_heads=2,
                                       head_dim=16, state_size=4, n_groups=1, vocab_size=VOCAB,
                                       expand=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    raises_everywhere(ValueError, lambda: hf.recurrent_parallel(model, comm),
                      match="(Mamba2Mixer) mixes tokens along the sequence, and "
                            "recurrent_parallel does not implement it")
