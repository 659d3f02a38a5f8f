"""``commlib.bindings.transformers.generate`` for hybrid models made
``recurrent_parallel`` (a tiny Qwen3-Next: Gated DeltaNet, full attention
and MoE; a tiny Bamba: Mamba2 and full attention; a tiny Falcon-H1: both in
every layer; a tiny LFM2 and LFM2-MoE: a short convolution, no scan, beside
attention) against one process's ``model.generate`` on the unsharded
model (sdpa, transformers' own mixers and cache): the same greedy tokens,
prefilled in the zigzag (ring) and contiguous (Ulysses) layouts; the same
sampled tokens for a shared seed; a second turn from the returned cache;
expert parallelism together; what is refused, on every rank."""

import copy
import warnings

import pytest
from packaging.version import Version

import commlib

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")
from test_transformers_recurrent import FAMILIES, VOCAB, tiny_model  # noqa: E402

from commlib.bindings import transformers as cht  # noqa: E402
from commlib.inference import ShardedKVCache  # noqa: E402

# 2 ranks: zigzag's two pieces per rank, and a 17-token prompt whose last 4
# (the conv state) sit on both ranks; 3: a middle rank with one zigzag piece,
# prompt lengths the world size does not divide
WORLD_SIZES = (2, 3)

warnings.filterwarnings("ignore", message=".*(attention mask|deprecated|fast path).*")


def parallel(model, comm, experts=False):
    """A copy of ``model`` with its recurrent layers (and experts) parallel."""
    copied = copy.deepcopy(model)
    if experts:
        cht.expert_parallel(copied, comm)
    return cht.recurrent_parallel(copied, comm)


def tokens(batch, length, seed):
    """Prompt tokens away from the special ids 0 to 5 (Bamba's pad is 0)."""
    return torch.randint(6, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def cache_of(out):
    """transformers 5.17 names the field ``past_key_values``, 5.25 ``cache``."""
    return out.cache if "cache" in type(out).__dataclass_fields__ else out.past_key_values


# (rows, length) of the greedy prompts. transformers 5.17's Falcon-H1 decodes
# two rows wrongly in one process too (its gated norm squeezes the step's
# length and broadcasts [2, 1, d] against [2, d] into [2, 2, d]; 5.25 fixed it)
OLD_FALCON = Version(transformers.__version__) < Version("5.25")
PROMPTS = {name: ((1, 17), (1, 3)) + (() if name == "falcon_h1" and OLD_FALCON else ((2, 23),))
           for name in FAMILIES}


# greedy, with every step's scores returned
SCORED = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)


def same_generation(got, want) -> bool:
    """The same tokens, and the same scores at every step (float32 round-off
    apart: the sharded prefill sums in another order): the carried states
    move the scores more than the tokens of these tiny models."""
    return torch.equal(got.sequences, want.sequences) and len(got.scores) == len(want.scores) \
        and all(torch.allclose(g, w, rtol=1e-5, atol=1e-6)
                for g, w in zip(got.scores, want.scores))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """The family's tiny model (random decays from near 0 to near 1, so the
    states carried into decode matter), the same on every rank."""
    return request.param, tiny_model(request.param).eval()


@pytest.mark.parametrize("prefill", ["commlib_ring", "commlib_ulysses"])
def test_greedy_tokens_are_one_process_generates(comm, family, prefill):
    """Prompts of 17 tokens (one row), 3 (fewer than the conv kernel's 4:
    the conv state starts with zeros) and 23 (two rows): every rank's
    tokens and scores are those of model.generate in one process."""
    _, model = family
    sharded = parallel(model, comm)
    same = []
    for batch, length in PROMPTS[family[0]]:
        ids = tokens(batch, length, seed=length)
        want = model.generate(ids, max_new_tokens=8, **SCORED)
        got = cht.generate(sharded, ids, comm, max_new_tokens=8, prefill=prefill, **SCORED)
        same.append(same_generation(got, want))
    assert all_ranks(all(same)), same


def test_sampling_follows_the_shared_seed(comm, family):
    """Sampled with seed=s: the tokens of torch.manual_seed(s);
    model.generate(...)."""
    _, model = family
    ids = tokens(1, 19, seed=4)
    options = dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(5)
    want = model.generate(ids, **options)
    got = cht.generate(parallel(model, comm), ids, comm, seed=5, **options)
    assert all_ranks(torch.equal(got, want)), (got, want)


def test_a_second_turn_continues_the_states(comm, family):
    """Turn two's new tokens (run by every rank from the carried states):
    the tokens and scores of model.generate on the whole conversation."""
    _, model = family
    sharded = parallel(model, comm)
    out = cht.generate(sharded, tokens(1, 21, seed=6), comm, max_new_tokens=4,
                       return_dict_in_generate=True)
    ids = torch.cat([out.sequences, tokens(1, 7, seed=7)], dim=1)
    want = model.generate(ids, max_new_tokens=5, **SCORED)
    got = cht.generate(sharded, ids, comm, max_new_tokens=5, past_key_values=cache_of(out),
                       **SCORED)
    assert all_ranks(same_generation(got, want)), (got.sequences, want.sequences)


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2_moe"], indirect=True)  # with experts
def test_expert_parallel_together(comm, family):
    _, model = family
    ids = tokens(1, 17, seed=17)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    got = cht.generate(parallel(model, comm, experts=True), ids, comm, max_new_tokens=6)
    assert all_ranks(torch.equal(got, want)), (got, want)


BAD = {
    "not parallel": "call recurrent_parallel(model, comm) before generate",
    "compiled decode": "compile_decode is not implemented for models with recurrent layers",
    "a cache without states": "past_key_values must come from a generate on this model",
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_raises_on_every_rank(comm, bad):
    model = tiny_model("bamba")
    ids = tokens(1, 9, seed=1)
    options = dict(max_new_tokens=2)
    if bad != "not parallel":
        model = cht.recurrent_parallel(model, comm)
    if bad == "compiled decode":
        options["compile_decode"] = True
    elif bad == "a cache without states":
        options["past_key_values"] = ShardedKVCache(2, comm.size, comm.rank)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: cht.generate(model, ids, comm, **options), match=BAD[bad])
