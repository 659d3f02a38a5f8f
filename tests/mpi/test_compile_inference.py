"""Inference over the sharded KV cache under ``torch.compile`` (issue 37):
``commlib::decode_attention`` and ``commlib::chunk_attention`` trace with
no graph break (attention sinks among their inputs too), alone and inside a
Llama decode step (``generate``'s ``compile_decode=True``); compiled equals
eager bit for bit, and both equal torch SDPA (with sinks: the eager softmax
with the sink column) over the unsharded sequence; a decode step over a
``DecodeCache`` is traced once over ten steps as the cache grows; generate
with the compiled step gives model.generate's tokens, and a second turn
continues from the cache it filled; bad input raises (or, where a raise
would need a device read, turns NaN) on every rank."""

import warnings

import numpy as np
import pytest

import requires
from attention_reference import (
    masked_torch_reference,
    position_mask,
    relative_error,
    sink_reference,
)
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
requires.module("transformers")
from torch._dynamo.testing import CompileCounter  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig  # noqa: E402

from commlib.bindings import torch as ct  # noqa: E402
from commlib.bindings import transformers as cht  # noqa: E402
from commlib.errors import CollectiveMismatchError  # noqa: E402

# 2: a shard per rank; 3: positions striped unevenly (a rank keeps none of
# some steps), the chunk's ranks holding different counts
WORLD_SIZES = (2, 3)

warnings.filterwarnings("ignore", message=".*(attention mask|deprecated).*")
B, H, HK, D = 2, 4, 2, 16
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def whole(length, seed):
    """q, k, v [B, length, ., D] of the unsharded sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, length, H, D, generator=g), torch.randn(B, length, HK, D, generator=g),
            torch.randn(B, length, HK, D, generator=g))


def reference(q, k, v, q_positions, k_positions, causal=True, window=None, sinks=None):
    mask = position_mask(q_positions, k_positions, causal, window)
    if sinks is not None:  # gpt-oss's eager softmax with the sink column
        return sink_reference(q.numpy(), k.numpy(), v.numpy(), np.zeros(q.shape), mask,
                              sinks.numpy())[0]
    return masked_torch_reference(q.numpy(), k.numpy(), v.numpy(), np.zeros(q.shape),
                                  mask)[0]


SINKS = torch.tensor([0.5, 1.5, -1.0, 2.5])  # one per query head (H)


def compiles_as_eager(comm, op, args, want, **settings):
    """``op`` on ``args`` (q, k, v, q_positions, k_positions): no break under
    explain, compiled equals eager bit for bit, eager equals ``want``, on
    every rank."""
    def step(q, k, v, q_positions, k_positions):
        return op(q, k, v, comm, q_positions=q_positions, k_positions=k_positions,
                  causal=True, **settings)
    breaks = torch._dynamo.explain(step)(*args).graph_break_count
    compiled = torch.compile(step, fullgraph=True)(*args)
    eager = step(*args)
    error = relative_error(eager, want)
    assert all_ranks(breaks == 0 and torch.equal(compiled, eager) and error < 1e-5), \
        (breaks, error)


@pytest.mark.parametrize("window, sinks", [(None, None), ((5, 0), SINKS)],
                         ids=["plain", "window-sinks"])
def test_decode_attention_compiles_without_a_break_and_equals_eager(comm, window, sinks):
    """Two new tokens over a cache of 23 striped by position."""
    q, k, v = whole(25, seed=1)
    mine = np.flatnonzero(np.arange(25) % comm.size == comm.rank)
    args = (q[:, 23:], k[:, mine], v[:, mine], torch.tensor([23, 24]), torch.from_numpy(mine))
    compiles_as_eager(comm, ct.decode_attention, args,
                      reference(q[:, 23:], k, v, [23, 24], np.arange(25), window=window,
                                sinks=sinks),
                      window=window, sinks=sinks)


@pytest.mark.parametrize("method, sinks", [("pass_q", None), ("pass_kv", SINKS)],
                         ids=["pass_q", "pass_kv-sinks"])
def test_chunk_attention_compiles_without_a_break_and_equals_eager(comm, method, sinks):
    """A chunk of 9 new tokens against a cache of 14, both striped."""
    q, k, v = whole(23, seed=2)
    mine = np.flatnonzero(np.arange(23) % comm.size == comm.rank)
    new = mine[mine >= 14]
    args = (q[:, new], k[:, mine], v[:, mine], torch.from_numpy(new), torch.from_numpy(mine))
    compiles_as_eager(comm, ct.chunk_attention, args,
                      reference(q[:, new], k, v, new, np.arange(23), sinks=sinks),
                      method=method, sinks=sinks)


def test_a_decode_step_is_traced_once_over_ten_steps_as_the_cache_grows(comm):
    """A DecodeCache of 2 layers holding a prefill of 11 (contiguous
    shards), ten steps of one token each: one trace; each step's output is
    the eager step's, bit for bit, and SDPA's over the sequence so far."""
    q, k, v = whole(21, seed=3)
    cuts = np.linspace(0, 11, comm.size + 1).astype(int)
    held = np.arange(cuts[comm.rank], cuts[comm.rank + 1])
    caches = []
    for _ in range(2):  # one compiled, one eager
        cache = ct.DecodeCache(comm, 2, 12, batch=B, kv_heads=HK, head_dim=D,
                               dtype=torch.float32)
        for layer in range(2):
            cache.keys[layer][:, :held.size] = k[:, held] * (layer + 1)
            cache.values[layer][:, :held.size] = v[:, held]
        cache.positions[:held.size] = torch.from_numpy(held)
        cache.count.fill_(held.size)
        caches.append(cache)

    def step(cache, q, k, v, positions):
        cache.advance(positions)
        outs = []
        for layer in range(2):
            cache.store(layer, k * (layer + 1), v)
            outs.append(cache.attend(layer, q, positions, causal=True))
        return torch.stack(outs)
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    position = torch.zeros(1, dtype=torch.int64)
    same, errors = [], []
    for p in range(11, 21):
        position.fill_(p)
        token = (q[:, p:p + 1], k[:, p:p + 1], v[:, p:p + 1])
        got = compiled(caches[0], *token, position)
        eager = step(caches[1], *token, position)
        want = reference(q[:, p:p + 1], k[:, :p + 1] * 2, v[:, :p + 1], [p], np.arange(p + 1))
        same.append(torch.equal(got, eager))
        errors.append(relative_error(got[1], want))
    assert all_ranks(counter.frame_count == 1 and all(same) and max(errors) < 1e-5), \
        (counter.frame_count, same, max(errors))


def make_model(name):
    config = {"llama": lambda: LlamaConfig(**COMMON),
              "mistral-window": lambda: MistralConfig(**COMMON, sliding_window=8)}[name]()
    torch.manual_seed(0)  # the same model on every rank
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.quick_sample(1)  # a window's compiled decode: the decode attention test above
@pytest.mark.parametrize("name, batch", [("llama", 2), ("mistral-window", 1)])
def test_generate_with_a_compiled_decode_step_is_model_generate(comm, name, batch):
    """The decode step traced once, no break (fullgraph), the tokens of
    eager generate and of model.generate; a second turn (pass-Q) from the
    cache the compiled steps filled gives model.generate's tokens too."""
    model = make_model(name)
    ids = torch.randint(128, (batch, 13), generator=torch.Generator().manual_seed(7))
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    eager = cht.generate(model, ids, comm, max_new_tokens=8)
    counters.clear()
    out = cht.generate(model, ids, comm, max_new_tokens=8, compile_decode=True,
                       return_dict_in_generate=True)
    traced, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    more = torch.cat([out.sequences, torch.randint(128, (batch, 5))], dim=1)
    again = cht.generate(model, more, comm, max_new_tokens=3,
                         past_key_values=out.past_key_values, prefill_method="pass_q")
    assert all_ranks(traced == 1 and breaks == 0 and torch.equal(out.sequences, want)
                     and torch.equal(eager, want)
                     and torch.equal(again, model.generate(more, max_new_tokens=3,
                                                           do_sample=False))), (traced, breaks)


def test_bad_decode_input_raises_on_every_rank(comm):
    """Positions of another length than the queries, on one rank only."""
    q, k, v = whole(5, seed=4)
    count = 2 if comm.rank == comm.size - 1 else 1

    def call():
        ct.decode_attention(q[:, 4:], k, v, comm, q_positions=torch.arange(4, 4 + count),
                            k_positions=torch.arange(5), causal=True)
    raises_everywhere(CollectiveMismatchError, call, match="q_positions has 2 positions")


def test_decode_positions_that_differ_across_ranks_turn_nan_on_every_rank(comm):
    """The check without a device read: a rank decoding another position."""
    q, k, v = whole(6, seed=5)
    position = 5 if comm.rank else 4
    out = ct.decode_attention(q[:, 4:5], k, v, comm, q_positions=torch.tensor([position]),
                              k_positions=torch.arange(6), causal=True)
    assert all_ranks(bool(out.isnan().all())), out


def test_an_overflowed_decode_cache_turns_nan_and_then_raises_on_every_rank(comm):
    """Capacity 1 and three tokens: a rank keeps more than fit."""
    q, k, v = whole(3 * comm.size, seed=6)
    cache = ct.DecodeCache(comm, 1, 1, batch=B, kv_heads=HK, head_dim=D, dtype=torch.float32)
    for p in range(3 * comm.size):
        position = torch.tensor([p])
        cache.advance(position)
        cache.store(0, k[:, p:p + 1], v[:, p:p + 1])
        out = cache.attend(0, q[:, p:p + 1], position, causal=True)
    from commlib.inference import ShardedKVCache
    sharded = ShardedKVCache(1, comm.size, comm.rank)
    assert all_ranks(bool(out.isnan().all()))
    raises_everywhere(CollectiveMismatchError, lambda: cache.into(sharded, 3 * comm.size),
                      match="overflowed its capacity of 1")
