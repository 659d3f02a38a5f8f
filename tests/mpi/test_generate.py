"""``commlib.bindings.transformers.generate`` against one process's
``model.generate``: the same greedy tokens for Llama, Qwen3, Qwen3-MoE made
expert-parallel and Mistral with a sliding window shorter than the
sequence, for prompt lengths the world size does not divide, one row or
two, prefilled by the ring or Ulysses; a second turn against the cache by
pass-Q, pass-KV and replicated; sampling alike on every rank; the cache
holds this rank's ~1/P of the positions; bad input raises on every rank."""

import copy
import warnings

import numpy as np
import pytest

import commlib

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
requires.module("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    DiffLlamaConfig,
    DogeConfig,
    Gemma2Config,
    GenerationConfig,
    HrmTextConfig,
    Llama4TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from commlib.bindings import transformers as cht  # noqa: E402
from commlib.inference import ShardedKVCache  # noqa: E402

# prompt lengths the world size does not divide
WORLD_SIZES = (2, 3)

warnings.filterwarnings("ignore", message=".*(attention mask|deprecated).*")
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def make_model(name, size):
    configs = {"llama": lambda: LlamaConfig(**COMMON),
               "mistral-window": lambda: MistralConfig(**COMMON, sliding_window=8),
               "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),
               "qwen3-moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=16, num_experts=4 * size,
                                                   num_experts_per_tok=2,
                                                   moe_intermediate_size=32,
                                                   decoder_sparse_step=1)}
    torch.manual_seed(0)  # the same model on every rank
    return AutoModelForCausalLM.from_config(configs[name]()).eval()


def tokens(batch, length, seed):
    return torch.randint(128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("prefill", ["commlib_ring", "commlib_ulysses"])
@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen3", "qwen3-moe"])
def test_greedy_tokens_are_one_process_generates(comm, name, prefill):
    """Prompts of 37 tokens (one row) and 23 (two rows): the tokens of
    model.generate on one process, on every rank."""
    model = make_model(name, comm.size)
    sharded = cht.expert_parallel(copy.deepcopy(model), comm) if name == "qwen3-moe" else model
    same = []
    for batch, length in ((1, 37), (2, 23)):
        ids = tokens(batch, length, seed=length)
        want = model.generate(ids, max_new_tokens=10, do_sample=False)
        got = cht.generate(sharded, ids, comm, max_new_tokens=10, prefill=prefill)
        same.append(torch.equal(got, want))
    assert all_ranks(all(same)), same


@pytest.mark.parametrize("method", ["pass_q", "pass_kv", "auto"])
def test_a_second_turn_continues_from_the_sharded_cache(comm, method):
    """Turn two prefills only its new tokens against the cache (pass-Q or
    pass-KV; two new tokens, fewer than 3 or 4 ranks, run replicated): the
    tokens of model.generate on the whole conversation; the cache holds
    every position once, ~1/P of them on each rank."""
    model = make_model("llama", comm.size)
    first = tokens(1, 29, seed=3)
    out = cht.generate(model, first, comm, max_new_tokens=5, return_dict_in_generate=True)
    cache = cache_of(out)
    ok = []
    for extra in (9, 2):
        ids = torch.cat([out.sequences, tokens(1, extra, seed=extra)], dim=1)
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        out = cht.generate(model, ids, comm, max_new_tokens=4, past_key_values=cache,
                           prefill_method=method, return_dict_in_generate=True)
        ok.append(torch.equal(out.sequences, want))
    positions = np.concatenate(comm.mpi_comm.allgather(cache.positions))
    balanced = max(comm.mpi_comm.allgather(cache.tokens)) <= -(-cache.length // comm.size) + 2
    assert all_ranks(all(ok) and np.array_equal(np.sort(positions), np.arange(cache.length))
                     and balanced and isinstance(cache, ShardedKVCache)), ok


def test_sampling_is_alike_on_every_rank_and_follows_the_seed(comm):
    model = make_model("qwen3", comm.size)
    ids = tokens(2, 19, seed=4)

    def sampled(seed):
        return cht.generate(model, ids, comm, max_new_tokens=8, do_sample=True, top_k=20,
                            top_p=0.9, temperature=0.7, seed=seed)
    first, again, other = sampled(5), sampled(5), sampled(6)
    everyone = comm.mpi_comm.allgather(first.numpy().tobytes())
    assert all_ranks(len(set(everyone)) == 1 and torch.equal(first, again)
                     and not torch.equal(first, other))


def test_eos_stops_a_row_and_pads_it_as_generate_does(comm):
    """The first greedy token as eos for one row: model.generate's padding
    and its stop, exactly."""
    model = make_model("llama", comm.size)
    ids = tokens(2, 21, seed=8)
    eos = int(model.generate(ids[:1], max_new_tokens=2, do_sample=False)[0, -1])
    want = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    got = cht.generate(model, ids, comm, max_new_tokens=6, eos_token_id=eos, pad_token_id=0)
    assert all_ranks(torch.equal(got, want))


BAD = {
    "too-long": "exceed the model's 256 positions",
    "different-prompts": "different arguments",
    "different-options": "different arguments",
    "other-world": "continues only on the world that made it",
    "other-conversation": "another conversation",
    "left-padding": "the attention_mask masks some tokens",
    "beams": "does not implement num_beams",
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_raises_on_every_rank(comm, bad):
    if bad.startswith("different") and comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    model = make_model("llama", comm.size)
    ids = tokens(1, 15, seed=1)
    options = dict(max_new_tokens=3)
    last = comm.rank == comm.size - 1
    if bad == "too-long":
        options["max_new_tokens"] = 250
    elif bad == "different-prompts" and last:
        ids = tokens(1, 15, seed=2)
    elif bad == "different-options" and last:
        options["max_new_tokens"] = 4
    elif bad == "other-world":
        options["past_key_values"] = ShardedKVCache(2, comm.size + 1, comm.rank)
    elif bad == "other-conversation":
        options["past_key_values"] = _cache_of(model, comm)
    elif bad == "left-padding":
        options["attention_mask"] = torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)
    elif bad == "beams":
        options["num_beams"] = 2
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: cht.generate(model, ids, comm, **options), match=BAD[bad])


def _cache_of(model, comm):
    """The cache of another conversation."""
    out = cht.generate(model, tokens(1, 12, seed=9), comm, max_new_tokens=2,
                       return_dict_in_generate=True)
    return cache_of(out)


def cache_of(out):
    """The cache of a generate output: transformers 5.17 names the field
    ``past_key_values``, 5.25 ``cache`` (the old name a deprecated alias)."""
    return out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values


# families whose attention is not one call per layer: DiffLlama attends twice a layer (two
# softmaxes over the same keys); HRM-text runs its two stacks of layers again and again
# (here 1 layer a stack, 2 x (2 + 1) runs: 6 attention calls a forward)
UNROLLED = {"diffllama": lambda: DiffLlamaConfig(**COMMON),
            "hrm_text": lambda: HrmTextConfig(**{**COMMON, "num_hidden_layers": 1},
                                              H_cycles=2, L_cycles=2)}


def family_model(config, **options):
    torch.manual_seed(0)  # the same model on every rank
    return AutoModelForCausalLM.from_config(config, **options).eval()


@pytest.mark.parametrize("name", UNROLLED)
def test_layers_that_attend_twice_or_run_again_generate_as_one_process(comm, name):
    """A cache layer per attention call: model.generate's greedy tokens, for
    a first turn and a second one against the cache (9 new tokens: a chunk
    over the ranks); compile_decode, which keeps K and V by layer_idx, is
    refused on every rank, for the first turn and the second."""
    model = family_model(UNROLLED[name]())
    first = tokens(1, 13, seed=2)
    out = cht.generate(model, first, comm, max_new_tokens=5, return_dict_in_generate=True)
    second = torch.cat([out.sequences, tokens(1, 9, seed=9)], dim=1)
    again = cht.generate(model, second, comm, max_new_tokens=3, past_key_values=cache_of(out))
    assert all_ranks(torch.equal(out.sequences, model.generate(first, max_new_tokens=5,
                                                               do_sample=False))
                     and torch.equal(again, model.generate(second, max_new_tokens=3,
                                                           do_sample=False)))
    unrolled = "compile_decode is not implemented for a model whose attention calls are not one"
    raises_everywhere(ValueError, lambda: cht.generate(model, first, comm, max_new_tokens=2,
                                                       compile_decode=True), match=unrolled)
    raises_everywhere(ValueError, lambda: cht.generate(
        model, torch.cat([again, tokens(1, 4, seed=4)], dim=1), comm, max_new_tokens=2,
        past_key_values=cache_of(out), compile_decode=True), match=unrolled)


@pytest.mark.parametrize("prefill", ["commlib_ring", "commlib_ulysses"])
def test_gemma2_soft_capped_generates_as_one_process(comm, prefill):
    """Gemma2 (every score capped, a sliding window on alternate layers;
    weights drawn wide so that both change its scores): model.generate's
    greedy tokens and scores for a first turn (the sharded prefill, then
    decode) and a second one against the cache (a chunk). The reference is
    the eager model: transformers 5.17's SDPA path drops the cap (its
    scores differ from eager's by about 3 here), 5.25's keeps it."""
    config = Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16,
                          attn_logit_softcapping=1.0, sliding_window=8,
                          final_logit_softcapping=None, initializer_range=0.2)
    model = family_model(config)
    reference = family_model(config, attn_implementation="eager")
    options = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    first = tokens(1, 37, seed=37)
    out = cht.generate(model, first, comm, max_new_tokens=6, prefill=prefill, **options)
    second = torch.cat([out.sequences, tokens(1, 9, seed=9)], dim=1)
    again = cht.generate(model, second, comm, max_new_tokens=3, past_key_values=cache_of(out),
                         **options)
    same = [torch.equal(got.sequences, want.sequences) and all(
        torch.allclose(g, w, atol=1e-4) for g, w in zip(got.scores, want.scores))
        for got, want in ((out, reference.generate(first, max_new_tokens=6, **options)),
                          (again, reference.generate(second, max_new_tokens=3, **options)))]
    assert all_ranks(all(same)), same


def test_llama4_generates_as_one_process_where_its_chunks_cover_the_call(comm):
    """Llama 4 attends within chunks of config.attention_chunk_size tokens,
    which commlib does not implement: the 19 tokens of a call within chunks
    of 24 are model.generate's; chunks of 16 are refused up front, with the
    call's numbers, as is its layer without RoPE tuning its temperature from
    index 15 on (floor_scale 16)."""
    def llama4(chunk):
        return family_model(Llama4TextConfig(**COMMON, attention_chunk_size=chunk,
                                             no_rope_layers=[1, 0], intermediate_size_mlp=128,
                                             num_local_experts=2))
    model, prompt = llama4(24), tokens(1, 13, seed=3)
    got = cht.generate(model, prompt, comm, max_new_tokens=6)
    assert all_ranks(torch.equal(got, model.generate(prompt, max_new_tokens=6,
                                                     do_sample=False)))
    raises_everywhere(commlib.CollectiveMismatchError, lambda: cht.generate(
        llama4(16), prompt, comm, max_new_tokens=6),
        match="Llama4ForCausalLM attends within chunks of 16 tokens (config.attention_chunk_size")
    raises_everywhere(commlib.CollectiveMismatchError, lambda: cht.generate(
        llama4(16), prompt, comm, max_new_tokens=6), match="generate at most 3 new tokens")
    tuned = llama4(24)
    tuned.config.floor_scale = tuned.model.layers[1].self_attn.floor_scale = 16
    raises_everywhere(commlib.CollectiveMismatchError, lambda: cht.generate(
        tuned, prompt, comm, max_new_tokens=6),
        match="Llama4TextAttention (layer 1) tunes its attention temperature")


def test_doge_dynamic_mask_is_refused_by_name(comm):
    model = family_model(DogeConfig(**COMMON))
    raises_everywhere(ValueError, lambda: cht.generate(model, tokens(1, 13, seed=5), comm,
                                                       max_new_tokens=2),
                      match="DogeAttention (layer 0) passes its attention call an attention mask "
                            "of its own (a dynamic or learned mask")


def test_the_model_keeps_its_attention_and_refuses_it_outside_generate(comm):
    """generate restores the model's attention implementation; the
    generation attention called outside generate says so."""
    model = make_model("llama", comm.size)
    before = model.config._attn_implementation
    cht.generate(model, tokens(1, 9, seed=1), comm, max_new_tokens=2)
    model.set_attn_implementation(cht.GENERATION)
    try:
        with pytest.raises(RuntimeError, match="only inside"):
            model(tokens(1, 4, seed=1))
    finally:
        model.set_attn_implementation(before)
    assert all_ranks(model.config._attn_implementation == before)


# -- conformance: each case is model.generate in one process, or refused ----------
# A case: the prompt (rows, length), generate's options, and either nothing
# (the tokens of model.generate on every rank, and every global generator
# where model.generate leaves it) or the refusal every rank raises, with
# what model.generate does there: raises too, or masks tokens commlib
# would attend. "first" and "second" stand for the greedy tokens the model
# picks first and second for row 0 (so that an eos among them matters).
CASES = {
    "defaults, prompt longer than 20": dict(length=25),
    "defaults, prompt shorter than 20": dict(length=7),
    "max_length": dict(options=dict(max_length=13)),
    "max_length at the prompt": dict(options=dict(max_length=9),
                                     refused=("`max_length` is set to 9", "raises")),
    "max_new_tokens over max_length": dict(options=dict(max_new_tokens=3, max_length=30)),
    "max_new_tokens 0": dict(options=dict(max_new_tokens=0),
                             refused=("must be greater than 0", "raises")),
    "the model's generation_config": dict(model_config=dict(max_new_tokens=4)),
    "a generation_config": dict(options=dict(generation_config=dict(max_length=12))),
    "min_new_tokens past eos": dict(options=dict(max_new_tokens=6, min_new_tokens=4,
                                                 eos_token_id="first")),
    "min_length past eos": dict(options=dict(max_new_tokens=6, min_length=12,
                                             eos_token_id="first")),
    "eos as an int": dict(rows=2, options=dict(max_new_tokens=6, eos_token_id="second",
                                              pad_token_id=5)),
    "eos as a list": dict(rows=2, options=dict(max_new_tokens=6,
                                              eos_token_id=["first", "second"],
                                              pad_token_id=5)),
    "pad in the prompt": dict(pad_at=3, options=dict(max_new_tokens=4, pad_token_id=0),
                              refused=("contain pad_token_id 0", "masks")),
    "pad in the prompt, pad is eos": dict(pad_at=3, options=dict(max_new_tokens=4,
                                                                 pad_token_id=0,
                                                                 eos_token_id=0)),
    "pad in the prompt, attention_mask of ones": dict(pad_at=3, mask="ones",
                                                      options=dict(max_new_tokens=4,
                                                                   pad_token_id=0)),
    "attention_mask with a zero": dict(mask="zero", options=dict(max_new_tokens=4),
                                       refused=("attention_mask masks", "masks")),
    "attention_mask of another shape": dict(mask="short", options=dict(max_new_tokens=4),
                                            refused=("attention_mask must be", "raises")),
    "greedy": dict(options=dict(max_new_tokens=4)),
    "sampling with a seed": dict(seed=11, options=dict(max_new_tokens=6, do_sample=True,
                                                       top_k=30, temperature=0.8)),
    "sampling without a seed": dict(options=dict(max_new_tokens=6, do_sample=True,
                                                 top_p=0.9)),
    "a dict with the processed scores": dict(options=dict(max_new_tokens=5, min_new_tokens=3,
                                                          eos_token_id="first",
                                                          return_dict_in_generate=True,
                                                          output_scores=True)),
    "a second turn, defaults": dict(second_turn=True),
    "a second turn, min_new_tokens": dict(second_turn=True,
                                          options=dict(max_new_tokens=5, min_new_tokens=3,
                                                       eos_token_id="first")),
}


def _case_inputs(model, case):
    """The prompt and generate's options of ``case``, the same on every
    rank (the prompt drawn away from the special ids 0 to 5)."""
    ids = torch.randint(6, 128, (case.get("rows", 1), case.get("length", 9)),
                        generator=torch.Generator().manual_seed(case.get("length", 9)))
    if "pad_at" in case:
        ids[:, case["pad_at"]] = 0
    picks = model.generate(ids[:1], max_new_tokens=2, do_sample=False, eos_token_id=None)
    named = {"first": int(picks[0, -2]), "second": int(picks[0, -1])}

    def resolve(value):
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return named.get(value, value) if isinstance(value, str) else value
    options = {key: GenerationConfig(**value) if key == "generation_config" else resolve(value)
               for key, value in case.get("options", {}).items()}
    masks = {"ones": torch.ones_like(ids), "short": torch.ones_like(ids)[:, 1:],
             "zero": torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0)}
    if "mask" in case:
        options["attention_mask"] = masks[case["mask"]]
    return ids, options


@pytest.mark.parametrize("name", CASES)
def test_generate_conforms_to_model_generate(comm, name):
    """``name`` by commlib's generate on every rank, each rank's global
    torch generator in a state of its own: the tokens of model.generate in
    one process (sampling without a seed: drawn from rank 0's generator;
    with ``seed=s``: those of ``torch.manual_seed(s); model.generate(...)``),
    and every rank's generator left as model.generate leaves rank 0's
    (greedy and seeded: untouched); or, refused, the same clear error on
    every rank, where model.generate raises too or masks tokens."""
    case = CASES[name]
    model = make_model("llama", comm.size)
    for key, value in case.get("model_config", {}).items():
        setattr(model.generation_config, key, value)
    ids, options = _case_inputs(model, case)
    if case.get("second_turn"):
        out = cht.generate(model, ids, comm, max_new_tokens=3, return_dict_in_generate=True)
        options["past_key_values"] = cache_of(out)
        ids = torch.cat([out.sequences, tokens(1, 4, seed=4)], dim=1)
    reference = {key: value for key, value in options.items() if key != "past_key_values"}
    seed = case.get("seed")
    if "refused" in case:
        match, transformers_does = case["refused"]
        if transformers_does == "raises":
            with pytest.raises((ValueError, RuntimeError)):  # a mask too short: RuntimeError
                model.generate(ids, **reference)
        raises_everywhere(commlib.CollectiveMismatchError,
                          lambda: cht.generate(model, ids, comm, seed=seed, **options),
                          match=match)
        return
    torch.manual_seed(1000 + comm.rank)  # each rank's generator in a state of its own
    start = torch.get_rng_state()
    root = torch.from_numpy(comm.mpi_comm.bcast(start.numpy(), root=0))
    if seed is not None:
        torch.manual_seed(seed)
    else:
        torch.set_rng_state(root)
    want = model.generate(ids, **reference)
    after = torch.get_rng_state() if options.get("do_sample") and seed is None else start
    torch.set_rng_state(start)
    got = cht.generate(model, ids, comm, seed=seed, **options)
    if options.get("return_dict_in_generate"):
        assert all_ranks(same_output(got, want)), (got, want)
        got, want = got.sequences, want.sequences
    everyone = comm.mpi_comm.allgather(got.numpy().tobytes())
    assert all_ranks(torch.equal(got, want) and torch.equal(torch.get_rng_state(), after)
                     and len(set(everyone)) == 1), (got, want)


def same_output(got, want) -> bool:
    """generate's dict output is model.generate's of this transformers: its
    class, the same fields set (the cache under this version's name), the
    scores after the logits processors (eos held back: -inf) alike."""
    return (type(got) is type(want) and list(got.keys()) == list(want.keys())
            and isinstance(cache_of(got), ShardedKVCache)
            and len(got.scores) == len(want.scores)
            and all(torch.allclose(g, w, atol=1e-4) and torch.equal(g.isinf(), w.isinf())
                    for g, w in zip(got.scores, want.scores)))
