"""Ring and all-gather attention over a latent (``commlib.ring.latent``,
multi-head latent attention): output and every gradient (q, the latent,
the rotary key, both up-projections) equal the unsharded attention of the
expanded K and V, in float64, within 1e-12, under every layout and mask
family the ring takes, with q/k's head size unlike v's; each rank's
share of the weights' gradients adds up to the whole; only the latent
travels; and what the latent path does not take is refused on every rank."""

import functools

import numpy as np
import pytest

from commlib.errors import CollectiveMismatchError
from commlib.inference import latent_chunk_attention, latent_decode_attention, latent_keys
from commlib.ring import shard_sequence, unshard_sequence
from commlib.ring.latent import latent_ring_attention, latent_ring_attention_backward

import arrayimpl
import conformance
import requires
from attention_reference import relative_error
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")

WORLD_SIZES = (2, 3, 4)
# DeepSeek-V3's proportions, scaled down: 4 heads, nope 12 + rope 4 = 16 for q and k, v 8
HEADS, NOPE, ROPE, VALUE, RANK = 4, 12, 4, 8, 10
SCALE = 0.3
TOL = 1e-12
MASKINGS = ("none", "causal", "cu_seqlens", "window", "prefix_lm")


def full_inputs(length, seed=0):
    """q, latent, rope_k, w_uk, w_uv and dout of the whole sequence, float64."""
    rng = np.random.default_rng(seed)
    return {"q": rng.standard_normal((1, length, HEADS, NOPE + ROPE)),
            "latent": rng.standard_normal((1, length, RANK)),
            "rope_k": rng.standard_normal((1, length, ROPE)),
            "w_uk": rng.standard_normal((RANK, HEADS, NOPE)) / np.sqrt(RANK),
            "w_uv": rng.standard_normal((RANK, HEADS, VALUE)) / np.sqrt(RANK),
            "dout": rng.standard_normal((1, length, HEADS, VALUE))}


def reference(full, dense):
    """(out, dq, dlatent, drope_k, dw_uk, dw_uv): torch SDPA in float64 on the
    unsharded sequence, K and V expanded by autograd-tracked einsums."""
    t = {name: torch.tensor(x, requires_grad=name != "dout") for name, x in full.items()}
    k_nope = torch.einsum("bsr,rhn->bshn", t["latent"], t["w_uk"])
    rope = t["rope_k"][:, :, None, :].expand(-1, -1, HEADS, -1)
    k = torch.cat([k_nope, rope], dim=-1)
    v = torch.einsum("bsr,rhv->bshv", t["latent"], t["w_uv"])
    out = torch.nn.functional.scaled_dot_product_attention(
        t["q"].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=torch.tensor(dense), scale=SCALE).transpose(1, 2)
    out.backward(t["dout"])
    return [out.detach().numpy()] + [t[name].grad.numpy()
                                      for name in ("q", "latent", "rope_k", "w_uk", "w_uv")]


def sharded(comm, impl, full, options, layout, method, binding=False):
    """The same six through latent_ring_attention on this rank's shards (the
    torch binding's where ``binding``), gathered back to the whole sequence
    (weights' shares summed)."""
    keys = {key: options[key] for key in ("cu_seqlens", "mask") if key in options}
    mine = {name: impl.asarray(shard_sequence(full[name], comm, layout=layout, **keys)
                               if name not in ("w_uk", "w_uv") else full[name], "float64")
            for name in full}
    call = dict(options, layout=layout, method=method, softmax_scale=SCALE)
    call.setdefault("causal", False)
    args = [mine[name] for name in ("q", "latent", "rope_k", "w_uk", "w_uv")]
    if binding:  # through autograd: the custom op and its backward op
        from commlib.bindings import torch as ct
        for x in args:
            x.requires_grad_()
        out = ct.latent_ring_attention(*args, comm, **call)
        out.backward(mine["dout"])
        grads = [x.grad for x in args]
    else:
        out, lse = latent_ring_attention(*args, comm, return_lse=True, **call)
        grads = latent_ring_attention_backward(mine["dout"], *args, out, lse, comm, **call)
    assert all(impl.is_native(x) for x in (out, *grads))
    length = full["q"].shape[1] if not keys else None
    whole = [unshard_sequence(impl.to_numpy(x).astype(np.float64), comm, layout=layout,
                              length=length, **keys) for x in (out, *grads[:3])]
    return whole + [comm.allreduce(np.ascontiguousarray(impl.to_numpy(g), np.float64))
                    for g in grads[3:]]


CASES = [pytest.param(impl, layout, masking, method, id=f"{impl}-{layout}-{masking}-{method}",
                      marks=[] if impl in ("numpy", "torch-binding") else [pytest.mark.full])
         for impl in ("numpy", "torch", "torch-binding", "jax")
         for layout in ("contiguous", "zigzag")
         for masking in MASKINGS
         for method in ("ring", "allgather", "expanded")
         if masking != "prefix_lm" or layout == "zigzag"]


@pytest.mark.parametrize("impl, layout, masking, method", CASES)
def test_latent_attention_equals_the_expanded_attention(comm, impl, layout, masking, method):
    if impl == "jax":
        requires.module("jax")
        import jax
        jax.config.update("jax_enable_x64", True)
    length = conformance.length_of({"length": "divisible"}, comm.size)
    options, dense = conformance.visibility({"masking": masking, "length": "divisible"}, length)
    full = full_inputs(length, seed=len(masking) + comm.size)
    got = sharded(comm, arrayimpl.IMPLS[impl.split("-")[0]], full, options, layout, method,
                  binding=impl == "torch-binding")
    errors = [relative_error(g, w) for g, w in zip(got, reference(full, dense))]
    assert all_ranks(max(errors) <= TOL), f"errors (out, dq, dlatent, drope, dw_uk, dw_uv) {errors}"


@pytest.mark.parametrize("method", ["ring", "auto"])
def test_the_latent_is_all_that_travels(comm, method):
    """The ring's forward sends the latent and the rotary key, (r + d_rope)
    values a token, P - 1 hops: against the expanded K and V's
    h (d_nope + d_rope + d_v) values. "auto" sends the latent between
    hosts and the expanded heads within one (where the latent's extra
    expansion costs more than the bytes save)."""
    length = 4 * comm.size
    full = full_inputs(length)
    mine = {name: shard_sequence(full[name], comm, layout="zigzag")
            if name not in ("w_uk", "w_uv") else full[name] for name in full}
    sent = []
    shift = comm.ring_shift_async

    def counting(x, *args, **kwargs):
        sent.append(x.nbytes)
        return shift(x, *args, **kwargs)
    comm.ring_shift_async = counting
    try:
        latent_ring_attention(*(mine[n] for n in ("q", "latent", "rope_k", "w_uk", "w_uv")),
                              comm, layout="zigzag", causal=True, method=method)
    finally:
        del comm.ring_shift_async
    moved = RANK + ROPE if method == "ring" or comm.topology.num_nodes > 1 else \
        HEADS * (NOPE + ROPE + VALUE)
    assert all_ranks(sent == [(length // comm.size) * moved * 8] * (comm.size - 1)), sent


@pytest.mark.parametrize("name, shape, named", [
    ("method", "sparse", "latent attention takes method"),
    ("w_uv", (RANK + 1, HEADS, VALUE), "latent size (kv_lora_rank)"),
    ("w_uk", (RANK, HEADS, NOPE + 1), "nope"),
    ("w_uk", (RANK, HEADS + 1, NOPE), "heads"),
    ("rope_k", (1, 3, ROPE), "agree on batch and local sequence length"),
])
def test_bad_input_is_refused_everywhere(comm, name, shape, named):
    length = 4 * comm.size
    full = full_inputs(length)
    mine = {name: shard_sequence(full[name], comm, layout="contiguous")
            if name not in ("w_uk", "w_uv") else full[name] for name in full}
    call = {"method": shape if name == "method" else "ring"}
    if name != "method":
        mine[name] = np.zeros(shape)
    raises_everywhere(ValueError, lambda: latent_ring_attention(
        *(mine[n] for n in ("q", "latent", "rope_k", "w_uk", "w_uv")), comm,
        layout="contiguous", causal=True, **call), named)


def test_one_rank_with_other_weights_shapes_is_refused_everywhere(comm):
    length = 4 * comm.size
    full = full_inputs(length)
    mine = {name: shard_sequence(full[name], comm, layout="contiguous")
            if name not in ("w_uk", "w_uv") else full[name] for name in full}
    if comm.rank == comm.size - 1:  # a consistent model of its own: a narrower v
        mine["w_uv"] = np.ascontiguousarray(mine["w_uv"][:, :, :VALUE - 1])
    raises_everywhere(CollectiveMismatchError, lambda: latent_ring_attention(
        *(mine[n] for n in ("q", "latent", "rope_k", "w_uk", "w_uv")), comm,
        layout="contiguous", causal=True), "weights")


def expanded_decode_reference(q, latent, rope_k, w_uk, w_uv, visible):
    """Softmax attention of q [1, t, h, d] over the expanded K and V of the
    whole cache, ``visible`` [t, n], float64, written out."""
    k = np.concatenate([np.einsum("bnr,rhk->bnhk", latent, w_uk),
                        np.broadcast_to(rope_k[:, :, None], latent.shape[:2] + (HEADS, ROPE))],
                       axis=-1)
    v = np.einsum("bnr,rhv->bnhv", latent, w_uv)
    scores = np.einsum("bthd,bnhd->bhtn", q, k) * SCALE
    scores = np.where(visible[None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhtn,bnhv->bthv", weights, v)


CHUNKS = {"decode": None, "pass_q": "pass_q", "pass_kv": "pass_kv"}


@pytest.mark.parametrize("window", [None, (5, 0)])
@pytest.mark.parametrize("step", sorted(CHUNKS))
@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_absorbed_attention_over_the_latent_cache_is_the_expanded_attention(comm, impl, step,
                                                                          window):
    """New tokens over a 23-token cache striped by position, each rank
    holding only its positions' latents and rotary keys, attended in the
    latent space (the query multiplied into W_UK): two tokens the same on
    every rank (decode), or a chunk of 7 striped over the ranks (pass-Q,
    pass-KV); the output equals attention over the whole cache's expanded
    K and V."""
    cached, new = 23, 2 if step == "decode" else 7
    full = full_inputs(cached + new, seed=7)
    positions = np.arange(cached + new)
    mine = positions[positions % comm.size == comm.rank]
    asked = positions[cached:] if step == "decode" else mine[mine >= cached]
    array = arrayimpl.IMPLS[impl]
    keys = latent_keys(*(array.asarray(full[name][:, mine], "float64")
                         for name in ("latent", "rope_k")))
    attend = latent_decode_attention if step == "decode" else \
        functools.partial(latent_chunk_attention, method=CHUNKS[step])
    got = attend(array.asarray(full["q"][:, asked], "float64"), keys,
                 array.asarray(full["w_uk"], "float64"), array.asarray(full["w_uv"], "float64"),
                 comm, q_positions=asked, k_positions=mine, causal=True, window=window,
                 softmax_scale=SCALE)
    gap = asked[:, None] - positions[None, :]
    visible = (gap >= 0) & ((gap <= window[0]) if window else True)
    want = expanded_decode_reference(full["q"][:, asked], full["latent"], full["rope_k"],
                                     full["w_uk"], full["w_uv"], visible)
    assert array.is_native(got)
    assert all_ranks(relative_error(array.to_numpy(got), want) <= TOL)
