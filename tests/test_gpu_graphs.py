"""A decode step captured in a CUDA graph (issue 37), and its rehearsal on
the CPU.

The step (``Decoder.step``): a token's embedding through two layers, each
decode attention over this rank's ``DecodeCache`` (``bindings.torch``) and
an MoE layer through a fixed-capacity ``bindings.torch.Dispatcher``
(dispatch, the experts, combine), then the greedy next token, written into
the tensor the next step reads. Everything it needs lives in tensors it
updates in place (the token, its position, the cache, its count), so ten
replays of one captured step decode ten tokens.

- GPU (``gpu`` mark; a 1-rank communicator over NCCL): capture the step
  once, replay it ten times: the tokens of ten eager steps.
- CPU rehearsal (the same code on CPU tensors, no CUDAGraph): ten steps
  under ``test_moe_host_syncs``'s witnesses, which flag every torch call
  from commlib's inference, kernels, MoE and their torch bindings that
  would make the host wait for a GPU (``.item()``, ``bool()``,
  ``.tolist()``, ``.cpu()``, ``nonzero``, an upload of host data, ...)
  and every ``to_host`` read: none may happen; and the tokens are those of
  the same model computed without commlib (SDPA over the whole sequence,
  each token's experts summed directly).
"""

from pathlib import Path

import numpy as np
import pytest
from test_moe_host_syncs import COMMLIB, Reads, _torch_witness

import commlib
from commlib.backends import nccl

import arrayimpl
import requires

torch = requires.module("torch")
from torch.overrides import TorchFunctionMode  # noqa: E402

from commlib.bindings import torch as ct  # noqa: E402
from commlib.bindings.torch import _inference as torch_inference  # noqa: E402

BINDINGS = Path(ct.__file__).resolve().parent
# what the witness watches: commlib's code a decode step runs (not the
# transport, nor this file's model, whose calls are plainly device-only)
STEP_CODE = (COMMLIB / "inference", COMMLIB / "kernels", COMMLIB / "moe",
             COMMLIB / "namespace.py", BINDINGS / "_inference.py",
             BINDINGS / "_moe.py")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP, LAYERS = 64, 32, 4, 2, 8, 4, 2, 2
BATCH, PROMPT, STEPS = 2, 3, 10


class Decoder:
    """A tiny decoder whose ``step`` reads and writes only its own tensors."""

    def __init__(self, comm, device, moe=True):
        g = torch.Generator().manual_seed(0)

        def weight(*shape):
            return (torch.randn(*shape, generator=g) / shape[-2 if len(shape) > 1 else 0]
                    ** 0.5).to(device)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g).to(device)
        self.wq, self.wk, self.wv = (weight(LAYERS, HIDDEN, h * HEAD_DIM)
                                     for h in (HEADS, KV_HEADS, KV_HEADS))
        self.wo = weight(LAYERS, HEADS * HEAD_DIM, HIDDEN)
        self.router = weight(LAYERS, HIDDEN, EXPERTS)
        self.experts = weight(LAYERS, EXPERTS, HIDDEN, HIDDEN)
        self.head = weight(HIDDEN, VOCAB)
        self.moe = moe
        self.dispatcher = ct.Dispatcher(comm, EXPERTS, max_tokens_per_rank=BATCH)
        self.cache = ct.DecodeCache(comm, LAYERS, PROMPT + STEPS, batch=BATCH,
                                    kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                                    device=device)
        self.token = torch.arange(1, BATCH + 1, device=device)
        self.position = torch.zeros(1, dtype=torch.int64, device=device)

    def step(self) -> None:
        """The model on ``token`` at ``position``: the next token into
        ``token``, ``position`` + 1."""
        x = self.embed[self.token][:, None]
        self.cache.advance(self.position)
        for layer in range(LAYERS):
            q, k, v = (torch.matmul(x, w[layer]).reshape(BATCH, 1, -1, HEAD_DIM)
                       for w in (self.wq, self.wk, self.wv))
            self.cache.store(layer, k, v)
            seen = self.cache.attend(layer, q, self.position, causal=True)
            x = x + torch.matmul(seen.reshape(BATCH, 1, -1), self.wo[layer])
            if self.moe:
                x = x + self.mixture(layer, x[:, 0])[:, None]
        self.token.copy_(torch.matmul(x[:, 0], self.head).argmax(dim=-1))
        self.position += 1

    def mixture(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(torch.matmul(h, self.router[layer]), -1).topk(TOP)
        rows, handle = self.dispatcher.dispatch(h, chosen, weights)
        return self.dispatcher.combine(torch.tanh(torch.bmm(rows, self.experts[layer])), handle)

    def reset(self) -> None:
        self.cache.reset()
        self.token.copy_(torch.arange(1, BATCH + 1))
        self.position.zero_()

    def reference(self) -> list:
        """The tokens of PROMPT + STEPS steps from the first token, computed
        without commlib: SDPA over the whole sequence so far, each token's
        experts summed."""
        tokens, keys, values, made = torch.arange(1, BATCH + 1), [[] for _ in range(LAYERS)], \
            [[] for _ in range(LAYERS)], []
        cpu = {name: getattr(self, name).cpu() for name in
               ("embed", "wq", "wk", "wv", "wo", "router", "experts", "head")}
        for _ in range(PROMPT + STEPS):
            x = cpu["embed"][tokens][:, None]
            for layer in range(LAYERS):
                q, k, v = (torch.matmul(x, cpu[w][layer]).reshape(BATCH, 1, -1, HEAD_DIM)
                           .transpose(1, 2) for w in ("wq", "wk", "wv"))
                keys[layer].append(k)
                values[layer].append(v)
                seen = torch.nn.functional.scaled_dot_product_attention(
                    q, torch.cat(keys[layer], 2), torch.cat(values[layer], 2), enable_gqa=True)
                x = x + torch.matmul(seen.transpose(1, 2).reshape(BATCH, 1, -1),
                                     cpu["wo"][layer])
                if self.moe:
                    h = x[:, 0]
                    weights, chosen = torch.softmax(h @ cpu["router"][layer], -1).topk(TOP)
                    mixed = sum(weights[:, j, None] * torch.tanh(torch.einsum(
                        "bh,bhk->bk", h, cpu["experts"][layer][chosen[:, j]]))
                        for j in range(TOP))
                    x = x + mixed[:, None]
            tokens = torch.matmul(x[:, 0], cpu["head"]).argmax(dim=-1)
            made.append(tokens.tolist())
        return made


class _OpBodies(TorchFunctionMode):
    """Runs the inference ops' bodies in place of the ops, so that a
    witness outside sees the calls inside them (torch runs a custom op's
    body with the modes of its caller switched off)."""

    BODIES = {torch.ops.commlib.decode_attention.default:
              torch_inference.decode_attention_op._init_fn,
              torch.ops.commlib.chunk_attention.default:
              torch_inference.chunk_attention_op._init_fn}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.BODIES.get(func, func)(*args, **(kwargs or {}))


def _eager(decoder: Decoder) -> list:
    made = []
    for _ in range(PROMPT + STEPS):
        decoder.step()
        made.append(decoder.token.tolist())
    return made


@pytest.mark.gpu
@pytest.mark.skipif(nccl.unavailable_reason() is not None,
                    reason=f"no NCCL: {nccl.unavailable_reason()}")
def test_cuda_graph_of_a_decode_step_replays_the_eager_tokens():
    """Three eager steps fill the prompt; the fourth is captured; ten
    replays decode the tokens ten eager steps decode (and the tokens
    computed without commlib)."""
    reason = arrayimpl.cuda_skip_reason("torch")
    if reason is not None:
        pytest.skip(reason)
    comm = commlib.init(backend="nccl", timeout=60)
    try:
        decoder = Decoder(comm, "cuda")
        want = _eager(decoder)
        decoder.reset()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the default stream, as torch asks
            decoder.step()
        torch.cuda.current_stream().wait_stream(side)
        decoder.reset()
        made = [None] * PROMPT
        for index in range(PROMPT):
            decoder.step()
            made[index] = decoder.token.tolist()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            decoder.step()
        for _ in range(STEPS):
            graph.replay()
            made.append(decoder.token.tolist())
        assert made == want
        assert want == decoder.reference()
    finally:
        comm.free()


@pytest.fixture(scope="module")
def comm():
    c = commlib.init()
    yield c
    c.free()


@pytest.mark.parametrize("moe", [True, False], ids=["attention+moe", "attention"])
def test_the_decode_step_reads_nothing_back_rehearsed_on_the_cpu(comm, monkeypatch, moe):
    """The GPU test's step on CPU tensors: no call that would wait for a
    GPU, no ``to_host``; the tokens are the reference's, and a reset cache
    decodes them again."""
    reads, found = Reads(monkeypatch), []
    decoder = Decoder(comm, "cpu", moe=moe)
    decoder.step()  # a first dispatch may set things up: the GPU test's warm-up
    decoder.reset()
    with _torch_witness(STEP_CODE) as witness, _OpBodies(), reads.during(found):
        for _ in range(PROMPT + STEPS):
            decoder.step()
    assert witness.waits == [] and found == [], (witness.waits, found)
    decoder.reset()
    assert _eager(decoder) == decoder.reference()


def test_the_rehearsal_flags_what_a_step_must_not_do(comm):
    """The witness sees the reads the rehearsal must not find, inside the
    ops too: decode attention given host positions, two queries under a
    window (``commlib.inference``'s host path uploads the mask of the
    window's edge), ``chunk_attention`` (its positions read on the host),
    a DecodeCache's ``into`` (its count)."""
    from commlib.inference import ShardedKVCache, decode_attention

    q, k = torch.ones(1, 2, 2, 4), torch.ones(1, 5, 2, 4)
    positions = torch.arange(5)
    cache = ct.DecodeCache(comm, 1, 4, batch=1, kv_heads=2, head_dim=4, dtype=torch.float32)
    calls = {
        "host decode": lambda: decode_attention(q, k, k, comm, q_positions=[3, 4],
                                                k_positions=np.arange(5), causal=True,
                                                window=(2, 0)),
        "chunk": lambda: ct.chunk_attention(q, k, k, comm, q_positions=positions[3:],
                                            k_positions=positions, causal=True),
        "into": lambda: cache.into(ShardedKVCache(1, comm.size, comm.rank), 0)}
    flagged = {}
    for name, call in calls.items():
        with _torch_witness(STEP_CODE) as witness, _OpBodies():
            call()
        flagged[name] = witness.waits
    assert all(flagged.values()), flagged
