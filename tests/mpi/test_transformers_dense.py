"""transformers over commlib, dense models: a tiny GQA Llama trained with
each context-parallel attention implementation matches the unsharded model
(loss, gradients, 20 optimizer steps), on packed documents it matches the
documents run one by one, a sliding-window Mistral and a Gemma2 (logit
soft-capping, sliding windows on alternate layers) match their unsharded
selves, and what commlib does not implement is refused on every rank."""

import copy

import numpy as np
import pytest

import commlib
from commlib.ring import shard_sequence, unshard_sequence

import requires
from conftest import all_ranks, raises_everywhere

transformers = requires.module("transformers")
torch = requires.module("torch")
hf = requires.module("commlib.bindings.transformers")
from commlib.bindings.transformers._attention import LAYOUTS, mark_checked  # noqa: E402
from commlib.bindings.transformers._experts import EXPERT_PARALLEL  # noqa: E402

# a model sharded 2 ways, 3 (uneven Ulysses heads, the refusals and Llama 4 chunks at an
# odd size, which issue 53 asked for) and the 2 x 2 hybrid
WORLD_SIZES = (2, 3, 4)

KINDS = tuple(LAYOUTS)
# commlib_ring_docs lays one unpacked sequence out as commlib_ring does
TRAINED = tuple(kind for kind in KINDS if kind != "commlib_ring_docs")
SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM = 24, 2, 4, 2, 16  # 2P divides SEQ at 1-4 ranks
DOCUMENTS = (5, 1, 11, 8)  # packed: 25 tokens, which 2P divides at no world size
WINDOW = 5  # Mistral's sliding window, shorter than SEQ
STEPS, LR, TOL = 20, 0.1, 1e-5


def tiny_config(family=transformers.LlamaConfig, **options):
    return family(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, num_hidden_layers=2, intermediate_size=128,
                  vocab_size=128, max_position_embeddings=2 * SEQ, attention_dropout=0.0,
                  **options)


def global_batch():
    """The same batch on every rank; some labels ignored, so the global
    token count is not the sequence length."""
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 128, (BATCH, SEQ), generator=gen)
    labels = input_ids.clone()
    labels[0, :7] = -100
    return {"input_ids": input_ids, "labels": labels}


def packed_batch():
    """DOCUMENTS packed into one row by transformers' DataCollatorWithFlattening
    (position ids restarting at 0, label -100 at every document's first
    token), with its flash-attention offsets."""
    gen = torch.Generator().manual_seed(7)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    return collate([{"input_ids": torch.randint(0, 128, (n,), generator=gen).tolist()}
                    for n in DOCUMENTS])


def model_with(reference, implementation):
    """A copy of ``reference`` attending with ``implementation`` (its own
    config: from_config would switch the reference's shared one too)."""
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(reference.config),
                                                          attn_implementation=implementation)
    model.load_state_dict(reference.state_dict())
    return model


def close(got, want, tol=TOL):
    """Within ``tol`` of the reference, relative to its largest entry."""
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    return bool((got - want).abs().max() <= tol * max(float(want.abs().max()), 1e-3))


def world_sum(comm, value):
    return float(comm.allreduce(np.array([float(value)]))[0])


def gradients(model):
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def new_model(config, seed, attn_implementation="sdpa"):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation)


@pytest.fixture(scope="module")
def reference(comm):
    """The unsharded model (sdpa), its first loss and gradients, and its
    losses and weights over STEPS optimizer steps."""
    hf.register(comm)
    model = new_model(tiny_config(), seed=0)
    initial = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(**global_batch()).loss
        loss.backward()
        grads = grads or gradients(model)
        losses.append(loss.item())
        optimizer.step()
    return {"model": initial, "grads": grads, "loss": losses[0], "losses": losses,
            "trained": dict(model.named_parameters())}


@pytest.fixture(scope="module")
def packed_reference(reference):
    """The packed batch's loss and gradients from the unsharded model (sdpa)
    run on each document alone: the documents' token losses summed, over
    the packed batch's count of predicted tokens."""
    model = copy.deepcopy(reference["model"])
    batch = packed_batch()
    count = int((batch["labels"][:, 1:] != -100).sum())
    offsets = batch["cu_seq_lens_q"].tolist()
    loss = sum(model(input_ids=batch["input_ids"][:, start:stop],
                     labels=batch["labels"][:, start:stop], num_items_in_batch=count).loss
               for start, stop in zip(offsets, offsets[1:]))
    loss.backward()
    return {"model": reference["model"], "loss": loss.item(), "grads": gradients(model)}


@pytest.fixture(scope="module")
def mistral_reference(comm):
    """A tiny Mistral whose sliding window is shorter than the sequence:
    the unsharded model (sdpa, which masks the window), its loss and
    gradients."""
    hf.register(comm)
    model = new_model(tiny_config(transformers.MistralConfig, sliding_window=WINDOW), seed=1)
    initial = copy.deepcopy(model)
    loss = model(**global_batch()).loss
    loss.backward()
    return {"model": initial, "loss": loss.item(), "grads": gradients(model)}


# Gemma2's cap and window, small enough to change this tiny model's loss
# (weights drawn wide: at the usual 0.02 its scores are too small to cap)
GEMMA2 = dict(head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=1.0,
              sliding_window=WINDOW, initializer_range=0.2)


@pytest.fixture(scope="module")
def gemma2_reference(comm):
    """A tiny Gemma2 (its layers alternate a sliding window and full
    attention; every score capped): the unsharded model (eager, the only
    transformers attention that caps), its loss and gradients; and the
    same weights without the cap or the window lose otherwise (both
    matter here)."""
    hf.register(comm)
    config = tiny_config(transformers.Gemma2Config, **GEMMA2)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    model = new_model(config, seed=2, attn_implementation="eager")
    initial = copy.deepcopy(model)
    loss = model(**global_batch()).loss
    loss.backward()
    for change in ({"attn_logit_softcapping": None}, {"sliding_window": 2 * SEQ}):
        other = new_model(tiny_config(transformers.Gemma2Config, **{**GEMMA2, **change}),
                          seed=2, attn_implementation="eager")
        assert abs(other(**global_batch()).loss.item() - loss.item()) > 1e-3 * loss.item()
    return {"model": initial, "loss": loss.item(), "grads": gradients(model)}


_TINY_MODELS = {}


def tiny_model(implementation):
    """A tiny Llama attending with ``implementation``, for shard_batch to
    check and cut for (made once per implementation)."""
    if implementation not in _TINY_MODELS:
        _TINY_MODELS[implementation] = new_model(tiny_config(), seed=0,
                                                 attn_implementation=implementation)
    return _TINY_MODELS[implementation]


def ring_batch(batch, comm):
    return hf.shard_batch(batch, comm, attn_implementation=tiny_model("commlib_ring"))


def sharded_step(model, comm, implementation, batch=None):
    """One forward and backward on this rank's shard; the global loss."""
    shard = hf.shard_batch(global_batch() if batch is None else batch, comm,
                           attn_implementation=model)
    loss = model(**shard).loss
    loss.backward()
    hf.allreduce_gradients(model, comm)
    return world_sum(comm, loss.item())


def first_step_matches(comm, want, implementation, batch=None):
    """The sharded model's global loss and gradients equal ``want``'s."""
    model = model_with(want["model"], implementation)
    loss = sharded_step(model, comm, implementation, batch)
    ok = abs(loss - want["loss"]) <= TOL * abs(want["loss"])
    for name, parameter in model.named_parameters():
        ok = ok and close(parameter.grad, want["grads"][name])
    return all_ranks(ok)


@pytest.mark.parametrize("implementation", KINDS)
def test_loss_and_gradients_match_the_unsharded_model(comm, reference, implementation):
    assert first_step_matches(comm, reference, implementation)


@pytest.mark.parametrize("implementation", KINDS)
def test_packed_documents_match_each_document_alone(comm, packed_reference, implementation):
    assert first_step_matches(comm, packed_reference, implementation, packed_batch())


@pytest.mark.parametrize("implementation", KINDS)
def test_a_sliding_window_matches_the_unsharded_model(comm, mistral_reference, implementation):
    assert first_step_matches(comm, mistral_reference, implementation)


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("implementation", KINDS)
def test_gemma2_soft_capped_matches_the_unsharded_model(comm, gemma2_reference, implementation):
    """Gemma2's capped scores (commlib's softcap=, the tiled kernel) and its
    alternate sliding-window layers: loss and gradients of the unsharded
    eager model."""
    assert first_step_matches(comm, gemma2_reference, implementation)


@pytest.mark.parametrize("implementation", TRAINED)
def test_training_matches_the_unsharded_model(comm, reference, implementation):
    model = model_with(reference["model"], implementation)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        losses.append(sharded_step(model, comm, implementation))
        optimizer.step()
    ok = close(losses, reference["losses"])
    for name, parameter in model.named_parameters():
        ok = ok and close(parameter.detach(), reference["trained"][name].detach())
    assert all_ranks(ok)


@pytest.mark.parametrize("implementation", KINDS)
@pytest.mark.parametrize("packed", [False, True], ids=["one sequence", "packed"])
def test_shard_batch_shifts_labels_on_the_whole_sequence(comm, implementation, packed):
    """Labels shifted on the whole sequence, padding (the packed batch's 25
    tokens need some in the zigzag layouts) ignored, positions restarting
    per document, the global offsets for the attention."""
    if packed:
        batch, items = packed_batch(), sum(n - 1 for n in DOCUMENTS)
        offsets, positions = batch["cu_seq_lens_q"].tolist(), batch["position_ids"]
    else:
        batch, items = global_batch(), BATCH * (SEQ - 1) - 6
        offsets, positions = [0, SEQ], torch.arange(SEQ).expand(BATCH, SEQ)
    shard = hf.shard_batch(batch, comm, attn_implementation=tiny_model(implementation))
    layout = LAYOUTS[implementation]
    shifted, got_positions = (unshard_sequence(shard[key], comm, layout=layout,
                                               cu_seqlens=offsets)
                              for key in ("shift_labels", "position_ids"))
    predicted = world_sum(comm, (shard["shift_labels"] != -100).sum())
    assert all_ranks(
        shifted[:, :-1].equal(batch["labels"][:, 1:]) and bool((shifted[:, -1] == -100).all())
        and got_positions.equal(positions) and predicted == items
        and int(shard["num_items_in_batch"]) == items
        and shard["labels"] is shard["shift_labels"] and "attention_mask" not in shard
        and shard["cu_seq_lens_q"].tolist() == shard["cu_seq_lens_k"].tolist() == offsets
        and shard["max_length_q"] == shard["max_length_k"] == max(np.diff(offsets)))


def attention_call(comm, implementation, heads=HEADS, kv_heads=KV_HEADS):
    """q, k, v shards as transformers passes them ([b, h, s_local, d]) and
    the unsharded causal attention's output shard ([b, s_local, h, d])."""
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(BATCH, SEQ, h, HEAD_DIM, generator=gen)
               for h in (heads, kv_heads, kv_heads))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    layout = LAYOUTS[implementation]
    shards = [shard_sequence(t, comm, layout=layout).transpose(1, 2) for t in (q, k, v)]
    return shards, shard_sequence(want, comm, layout=layout)


def registered(implementation):
    return transformers.AttentionInterface()[implementation]


class CausalModule(torch.nn.Module):
    """An attention layer alone, as transformers passes it to the attention:
    no model around it for shard_batch to check, so it is vouched for."""

    is_causal = True

    def __init__(self):
        super().__init__()
        mark_checked(self)


@pytest.mark.parametrize("implementation", KINDS)
def test_bookkeeping_keyword_arguments_are_accepted(comm, reference, implementation):
    (q, k, v), want = attention_call(comm, implementation)
    positions = shard_sequence(torch.arange(SEQ)[None], comm, layout=LAYOUTS[implementation])
    out, weights = registered(implementation)(
        CausalModule(), q, k, v, None, dropout=0.0, scaling=HEAD_DIM**-0.5,
        position_ids=positions, use_cache=True, num_items_in_batch=7,
        shift_labels=torch.zeros(1), output_attentions=False, sliding_window=None,
        softcap=None, s_aux=None, cu_seq_lens_q=None)
    assert all_ranks(weights is None and close(out, want))


def test_hybrid_runs_at_a_given_ulysses_size(comm, reference):
    degree = 2 if comm.size % 2 == 0 else 1  # at 4 ranks: Ulysses 2 x Ring 2
    hf.register(comm, ulysses_size=degree)
    try:
        (q, k, v), want = attention_call(comm, "commlib_hybrid")
        out, _ = registered("commlib_hybrid")(CausalModule(), q, k, v, None)
    finally:
        hf.register(comm)
    assert all_ranks(close(out, want))


@pytest.mark.parametrize("extra, named", [
    ({"softcap": -1.0}, "softcap must be a positive"),
    ({"s_aux": torch.zeros(HEADS + 1)}, "sinks must have shape"),
    ({"sliding_window": 4, "is_causal": False}, "bidirectional sliding window"),
    ({"dropout": 0.1}, "dropout"), ({"position_bias": torch.zeros(1)}, "position_bias"),
    ({"output_attentions": True}, "output_attentions"),
    ({"cu_seq_lens_q": torch.tensor([0, SEQ]), "cu_seq_lens_k": torch.tensor([0, 5, SEQ])},
     "cu_seq_lens_q [0, 24] and cu_seq_lens_k [0, 5, 24] differ"),
    ({"seq_idx": torch.zeros(1, SEQ)}, "seq_idx"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"attention_mask": torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool)}, "attention mask")])
def test_what_changes_the_math_is_refused_by_name(comm, reference, extra, named):
    (q, k, v), _ = attention_call(comm, "commlib_ring")
    arguments = {"attention_mask": None, **extra}
    raises_everywhere(ValueError, lambda: registered("commlib_ring")(CausalModule(), q, k, v,
                                                                      **arguments),
                      match=named)


def test_ulysses_refuses_fewer_heads_than_ranks(comm, reference):
    if comm.size == 1:
        pytest.skip("one head splits over one rank")
    (q, k, v), _ = attention_call(comm, "commlib_ulysses", heads=comm.size - 1, kv_heads=1)
    raises_everywhere(ValueError, lambda: registered("commlib_ulysses")(CausalModule(), q, k, v,
                                                                         None),
                      match="Ulysses splits the attention heads")


def test_hybrid_refuses_a_degree_that_does_not_divide_the_world(comm):
    raises_everywhere(ValueError, lambda: hf.register(comm, ulysses_size=comm.size + 1),
                      match="must divide the world size")


@pytest.fixture
def with_commlib(comm):
    """commlib's attention registered over ``comm`` (a test run alone)."""
    hf.register(comm)
    return comm


def llama4(chunk, **options):
    """A tiny Llama 4 whose layer 0 attends within chunks of ``chunk``
    tokens (config.attention_chunk_size) and layer 1 (no RoPE, its
    temperature tuned from index floor_scale - 1 on) causally over the
    whole sequence; unsharded (sdpa)."""
    return new_model(tiny_config(transformers.Llama4TextConfig, attention_chunk_size=chunk,
                                 no_rope_layers=[1, 0], intermediate_size_mlp=128,
                                 num_local_experts=2, **options), seed=3)


def llama4_reference(chunk, batch):
    """The unsharded Llama 4's loss and gradients on ``batch`` (one
    sequence), or on each of its packed documents alone (summed over the
    packed count, as packed_reference)."""
    model = llama4(chunk)
    initial = copy.deepcopy(model)
    offsets = batch["cu_seq_lens_q"].tolist() if "cu_seq_lens_q" in batch else [0, None]
    count = int((batch["labels"][:, 1:] != -100).sum())
    loss = sum(model(input_ids=batch["input_ids"][:, start:stop],
                     labels=batch["labels"][:, start:stop], num_items_in_batch=count).loss
               for start, stop in zip(offsets, offsets[1:]))
    loss.backward()
    return {"model": initial, "loss": loss.item(), "grads": gradients(model)}


def one_sequence(length):
    input_ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(6))
    return {"input_ids": input_ids, "labels": input_ids.clone()}


# (chunk, batch): chunks that cover the user's sequence (or every packed document), though
# not the probe's tokens times the ranks, nor the zigzag shards' padded length (17 tokens
# padded to 20 at 2 ranks, 24 at 4)
CHUNKS_THAT_COVER = {"16 tokens, chunks of 20": (20, lambda: one_sequence(16)),
                     "17 tokens, chunks of 17": (17, lambda: one_sequence(17)),
                     "documents of up to 11 tokens, chunks of 11": (11, packed_batch)}


@pytest.mark.parametrize("case", CHUNKS_THAT_COVER)
@pytest.mark.parametrize("implementation", [
    "commlib_ring", pytest.param("commlib_ulysses", marks=pytest.mark.full)])
def test_llama4_whose_chunks_cover_the_sequence_matches_the_unsharded_model(with_commlib, case,
                                                                             implementation):
    chunk, batch = CHUNKS_THAT_COVER[case]
    assert first_step_matches(with_commlib, llama4_reference(chunk, batch()), implementation,
                              batch())


@pytest.mark.parametrize("options, batch, named", [
    (dict(chunk=8), lambda: one_sequence(16),
     "(layer 0) attends within chunks of 8 tokens, shorter than this batch's longest "
     "sequence of 16 tokens"),
    (dict(chunk=10), packed_batch,
     "(layer 0) attends within chunks of 10 tokens, shorter than this batch's longest "
     "document of 11 tokens"),
    (dict(chunk=20, floor_scale=8), lambda: one_sequence(16),
     "(layer 1) tunes its attention temperature")],
    ids=["chunks, one sequence", "chunks, packed", "temperature"])
def test_llama4_past_its_lengths_is_refused_by_name(with_commlib, options, batch, named):
    """Chunked attention, which commlib does not implement, and the
    temperature tuning of the layer without RoPE, which counts a shard's
    tokens, past the lengths where they change nothing: refused by the
    layer on every rank, with the user's numbers."""
    model = model_with(llama4(**options), "commlib_ring")
    shard = hf.shard_batch(batch(), with_commlib, attn_implementation=model)
    raises_everywhere(ValueError, lambda: model(**shard), match=f"Llama4TextAttention {named}")


def test_chunks_the_config_does_not_place_are_refused(with_commlib):
    """A chunked mask asked of a config with no chunked layer: the mask
    function cannot tell which layers it is for, so it refuses."""
    config = tiny_config(transformers.Llama4TextConfig, attention_chunk_size=4,
                         no_rope_layers=[0, 0])  # no layer attends in chunks
    config._attn_implementation = "commlib_ring"
    embeddings = torch.zeros(1, 6, 8)  # this rank's 6 tokens
    raises_everywhere(ValueError, lambda: transformers.masking_utils.create_chunked_causal_mask(
        config, embeddings, None, None), match="does not say which layers attend so")


def test_doge_dynamic_mask_is_refused_by_name(with_commlib):
    """Doge hands its attention a mask of its own (its dynamic mask: a bias
    per key from the values), which is not padding: refused as such."""
    model = new_model(tiny_config(transformers.DogeConfig), seed=4,
                      attn_implementation="commlib_ring")
    shard = hf.shard_batch(global_batch(), with_commlib, attn_implementation=model)
    raises_everywhere(ValueError, lambda: model(**shard),
                      match="DogeAttention (layer 0) passes its attention call an attention mask "
                            "of its own (a dynamic or learned mask")


@pytest.mark.parametrize("positions, named", [
    (torch.cat([torch.ones(3), torch.arange(SEQ - 3)]), "must start at 0"),  # left padding
    (torch.cat([torch.arange(10), torch.arange(11, SEQ + 1)]), "count 0, 1, 2"),
    (torch.stack([torch.arange(SEQ), torch.arange(SEQ) % 12]), "every row packed alike")],
    ids=["left padding", "skipped position", "rows packed differently"])
def test_shard_batch_refuses_position_ids_that_are_not_documents(comm, positions, named):
    batch = {**global_batch(), "position_ids": positions.long()}
    raises_everywhere(ValueError, lambda: ring_batch(batch, comm), match=named)


def test_shard_batch_refuses_offsets_that_disagree_with_the_positions(comm):
    batch = {**packed_batch(), "cu_seq_lens_k": torch.tensor([0, 25], dtype=torch.int32)}
    raises_everywhere(ValueError, lambda: ring_batch(batch, comm),
                      match="cu_seq_lens_k [0, 25] disagrees with the documents")


def test_padding_is_refused(comm, reference):
    batch = global_batch()
    batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.int64)
    batch["attention_mask"][1, 0] = 0  # pads a token of rank 0's shard only
    raises_everywhere(ValueError, lambda: ring_batch(batch, comm), match="pads")
    model = model_with(reference["model"], "commlib_ring")
    shard = {key: shard_sequence(batch[key], comm, layout="zigzag")
             for key in ("input_ids", "attention_mask")}
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**shard), match="pads")


@pytest.mark.parametrize("implementation", ["commlib_ring", "commlib_ulysses", "commlib_hybrid"])
def test_a_batch_sharded_for_another_implementation_is_refused(comm, reference, implementation):
    """Every implementation reads every layout, so the layout a batch was
    sharded in must be the model's: a batch made for another
    implementation, or by hand without positions, raises on every rank."""
    if comm.size == 1:
        pytest.skip("one rank holds the whole sequence in every layout")
    model = model_with(reference["model"], implementation)
    own = hf.shard_batch(global_batch(), comm, attn_implementation=model)  # checks the model
    other = "commlib_ulysses" if implementation != "commlib_ulysses" else "commlib_ring"
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=tiny_model(other))
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**shard),
                      match="the batch was sharded for another layout")
    by_hand = {"input_ids": shard_sequence(global_batch()["input_ids"], comm,
                                           layout=LAYOUTS[implementation])}
    raises_everywhere(commlib.CollectiveMismatchError, lambda: model(**by_hand),
                      match="position_ids")
    assert all_ranks(own.keys() == shard.keys())


def test_shard_batch_takes_a_model_of_commlib_attention(comm):
    """A name is refused (nothing could check the model's other layers), and
    so is a model that attends otherwise."""
    raises_everywhere(ValueError, lambda: hf.shard_batch(global_batch(), comm,
                                                         attn_implementation="commlib_ring"),
                      match="shard_batch needs the model")
    raises_everywhere(ValueError, lambda: hf.shard_batch(global_batch(), comm,
                                                         attn_implementation=tiny_model("sdpa")),
                      match="attend with 'sdpa', not one of commlib's")


def test_a_model_nobody_checked_is_refused_by_its_attention(comm, reference):
    """A batch sharded by hand (with the right positions) reaching a model
    that shard_batch never checked: the attention refuses it, since a layer
    it cannot see might mix tokens."""
    model = model_with(reference["model"], "commlib_ring")
    shard = hf.shard_batch(global_batch(), comm, attn_implementation=tiny_model("commlib_ring"))
    raises_everywhere(ValueError, lambda: model(**shard), match="was not checked")


def test_allreduce_gradients_sums_replicated_parameters_only(comm):
    """Replicated gradients are summed (several buckets, two dtypes); an
    expert-parallel one is left alone; one missing on rank 0 is summed over
    the others; one missing everywhere stays missing."""
    model = torch.nn.ModuleDict({"dense": torch.nn.Linear(3, 5),
                                 "wide": torch.nn.Linear(4, 2).double(),
                                 "experts": torch.nn.Linear(2, 2),
                                 "unused_on_rank_0": torch.nn.Linear(2, 2),
                                 "unused": torch.nn.Linear(2, 2)})
    setattr(model["experts"].weight, EXPERT_PARALLEL, True)
    for name, parameter in model.named_parameters():
        if not name.startswith("unused") or (name.startswith("unused_on") and comm.rank):
            parameter.grad = torch.full_like(parameter, comm.rank + 1.0)
    hf.allreduce_gradients(model, comm, bucket_bytes=64)
    total = comm.size * (comm.size + 1) / 2
    elsewhere = total - 1 if comm.size > 1 else None
    expected = {"experts.weight": comm.rank + 1.0, "unused_on_rank_0.weight": elsewhere,
                "unused_on_rank_0.bias": elsewhere, "unused.weight": None, "unused.bias": None}
    ok = True
    for name, parameter in model.named_parameters():
        want = expected.get(name, total)
        ok = ok and (parameter.grad is None if want is None
                     else parameter.grad.dtype == parameter.dtype
                     and bool((parameter.grad == want).all()))
    assert all_ranks(ok)
