"""torch.compile of transformers' decoder blocks (Llama, Qwen3-MoE, their
experts eager or over ``expert_parallel`` at a fixed capacity) and whole
tiny models over the transformers binding: no graph break, forward and
backward, compiled equal to eager (``aot_eager``: bitwise; Qwen3-MoE's
grouped_mm experts within float32 rounding), one graph for three calls.

At 2 ranks only: what an odd ring changes under compile (zigzag's chunk
count, Ulysses' uneven heads in the ops' fake shapes) is the ops' own test
at 2 and 3 ranks (test_compile.py); the models add transformers' code
around the same ops, and each case compiles for seconds (about 150 s of
the 3-rank launch, measured under load)."""

import copy

import pytest

import requires
from conftest import all_ranks

WORLD_SIZES = (2,)

torch = requires.module("torch")
from compile_checks import (  # noqa: E402,F401 (fresh_dynamo: an autouse fixture)
    Counting,
    breaks,
    fresh_dynamo,
    identical,
    largest_error,
    run,
)

HEADS, KV_HEADS, DIM = 6, 3, 8

transformers = requires.module("transformers")
hf = requires.module("commlib.bindings.transformers")
from commlib.bindings.transformers._attention import LAYOUTS, mark_checked  # noqa: E402
from commlib.bindings.transformers._batch import sharded_batch  # noqa: E402

VOCAB, LOCAL = 96, 8  # LOCAL tokens per rank
TINY = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS, head_dim=DIM, vocab_size=VOCAB,
            max_position_embeddings=64, attention_dropout=0.0)
PACKED = (5, 2, 9)  # documents of a packed row (padded by shard_batch to the layout)


def _config(family):
    if family == "llama":
        return transformers.LlamaConfig(**TINY, intermediate_size=64)
    return transformers.Qwen3MoeConfig(**TINY, num_experts=6, num_experts_per_tok=2,
                                       moe_intermediate_size=16, intermediate_size=64,
                                       norm_topk_prob=True, output_router_logits=False)


def _batch(comm, implementation, packed=False):
    """shard_batch's shard of a seeded global row (packed: documents of
    PACKED, position ids restarting at 0), for ``implementation``: a model,
    or the name of a layer's attention (a layer alone: no model to check)."""
    gen = torch.Generator().manual_seed(11)
    batch = {"input_ids": torch.randint(VOCAB, (1, LOCAL * comm.size), generator=gen)}
    if packed:
        batch = {"input_ids": torch.randint(VOCAB, (1, sum(PACKED)), generator=gen),
                 "position_ids": torch.cat([torch.arange(n) for n in PACKED])[None]}
    if isinstance(implementation, str):
        return sharded_batch(batch, comm, layout=LAYOUTS[implementation])
    return hf.shard_batch(batch, comm, attn_implementation=implementation)


def _block(comm, family, implementation, expert_parallel=None):
    """A seeded decoder layer of ``family`` attending with ``implementation``,
    its rotary embedding, and a step: the layer on hidden states of the
    shard's positions (the batch's documents forwarded as the model does),
    summed against a probe."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer

    hf.register(comm)
    config = _config(family)
    config._attn_implementation = implementation
    config._experts_implementation = "grouped_mm"  # traceable (eager loops over experts hit)
    torch.manual_seed(0)
    layer = (LlamaDecoderLayer if family == "llama" else Qwen3MoeDecoderLayer)(config, 0)
    mark_checked(layer.self_attn)  # a layer alone: no model for shard_batch to check
    with torch.no_grad():  # a layer alone is not initialised (its experts: torch.empty)
        for parameter in layer.parameters():
            parameter.normal_(std=0.1)
    if expert_parallel is not None:  # the Dispatchers' fixed capacity
        hf.expert_parallel(layer, comm, max_tokens_per_rank=expert_parallel)
    rope = LlamaRotaryEmbedding(config)

    def step(hidden, probe, batch):
        documents = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k")}
        position = batch["position_ids"]
        out = layer(hidden, attention_mask=None, position_ids=position,
                    position_embeddings=rope(hidden, position), **documents)
        return ((out[0] if isinstance(out, tuple) else out) * probe).sum()
    return layer, step


def _hidden(batch, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = batch["input_ids"].shape + (TINY["hidden_size"],)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _block_checks(comm, step, layer, batch):
    """(breaks, reasons), compiled against eager (the largest error of the
    loss, input and parameter gradients) for three calls, and the graph
    count."""
    hidden, probe = _hidden(batch, 0)
    count, reasons = breaks(step, hidden, probe, batch)
    counting = Counting()
    compiled = torch.compile(step, backend=counting, fullgraph=True)
    same = []
    for call in range(3):
        hidden, probe = _hidden(batch, call)
        results = []
        for function in (compiled, step):
            layer.zero_grad()
            loss, (grad,) = run(function, [hidden], probe, batch)
            results.append((loss, [grad] + [p.grad.clone() for p in layer.parameters()
                                            if p.grad is not None]))
        same.append(largest_error(*results))
    return count, reasons, same, counting.graphs


BLOCK_ROUNDING = 1e-5
BLOCKS = [("llama", "commlib_ring", False), ("llama", "commlib_ulysses", False),
          ("llama", "commlib_hybrid", False), ("llama", "commlib_ring_docs", True),
          ("qwen3_moe", "commlib_ring", False), ("qwen3_moe", "commlib_hybrid", True)]


@pytest.mark.quick_sample(1)
@pytest.mark.parametrize("family, implementation, packed", BLOCKS)
def test_decoder_block_compiles_whole_and_equals_eager(comm, family, implementation, packed):
    """transformers' decoder layer with commlib attention (Qwen3-MoE's
    experts eager here, every rank holding them), fullgraph: no break
    (the attention read the packed documents' offsets on the host, then
    checked the positions there: a break at each), loss and gradients of
    the hidden states and every parameter equal eager's, one graph. The
    hybrid's planner (a collective probe) runs when traced, a constant."""
    layer, step = _block(comm, family, implementation)
    count, reasons, errors, graphs = _block_checks(comm, step, layer,
                                                   _batch(comm, implementation, packed))
    assert all_ranks(count == 0), reasons
    # Llama: bitwise; Qwen3-MoE's grouped_mm experts differ in float32 rounding
    assert all_ranks(max(errors) <= (0.0 if family == "llama" else BLOCK_ROUNDING)), errors
    assert all_ranks(graphs == 1), f"{graphs} graphs for 3 calls"


@pytest.mark.full
def test_qwen3_moe_block_with_expert_parallel_compiles_whole(comm):
    """The Qwen3-MoE block with its experts over ``expert_parallel`` at a
    fixed capacity (no host read: the experts forward takes [local experts,
    capacity, H]): no graph break, one graph, compiled equals eager. The
    counted mode's one break at the dispatch: test_moe_counted_dispatch_breaks_once."""
    batch = _batch(comm, "commlib_ring")
    layer, step = _block(comm, "qwen3_moe", "commlib_ring",
                         expert_parallel=batch["input_ids"].numel())
    count, reasons, errors, graphs = _block_checks(comm, step, layer, batch)
    assert all_ranks(count == 0), reasons
    assert all_ranks(max(errors) <= BLOCK_ROUNDING), errors
    assert all_ranks(graphs == 1), f"{graphs} graphs for 3 calls"


MODELS = [("llama", "commlib_ring"), ("llama", "commlib_hybrid"), ("qwen3_moe", "commlib_ulysses")]


@pytest.mark.full
@pytest.mark.parametrize("family, implementation", MODELS)
def test_compiled_model_equals_eager(comm, family, implementation):
    """``torch.compile(model)`` of a tiny causal LM on shard_batch's shard:
    the eager loss and every gradient, no graph break (Qwen3-MoE's experts
    eager: every rank holds them)."""
    hf.register(comm)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config(family), attn_implementation=implementation, dtype=torch.float32)
    twin = copy.deepcopy(model)
    batch = _batch(comm, model)
    _batch(comm, twin)  # checks the twin too: the attention refuses a model nobody checked
    count, reasons = breaks(lambda **b: model(**b).loss, **batch)
    compiled = torch.compile(twin, backend=Counting(), fullgraph=True)
    results = []
    for each in (compiled, model):
        loss = each(**batch).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in each.parameters()]))
    assert all_ranks(count == 0), reasons
    assert all_ranks(identical(*results))
