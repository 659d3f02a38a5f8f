"""The attention conformance matrix: every option of every attention entry
point, combined by a covering array (tests/covering.py), each case either
equal to the float64 reference on the unsharded sequence, forward and
backward (with attention sinks: the eager softmax with the sink column,
and the sinks' gradient summed over the ranks; with a cap, the eager
softmax of the capped scores), or refused on every rank with the error
this file predicts.

A case is a dict of factor -> value (``FACTORS``). ``expected_refusal``
is the oracle: the message a refused case must carry, or None where the
case must compute. ``run_case`` shards the global inputs, calls the entry
point on every rank, gathers outputs and gradients, and returns them as
float64 NumPy arrays of the whole sequence; ``reference`` computes the same
on one process.

Tiers: the quick tier (the README's ``pytest``) runs ``QUICK_CASES`` of
the matrix, sampled with a fixed seed; the full tier
(``COMMLIB_TEST_TIER=full``, CI) runs all of it.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from commlib import ring
from commlib.hybrid import hybrid_attention, hybrid_attention_backward
from commlib.sequence import common_masks, masks
from commlib.ulysses import ulysses_attention, ulysses_attention_backward

import arrayimpl
import covering
from attention_reference import document_mask, eager_reference, masked_torch_reference

TIER = os.environ.get("COMMLIB_TEST_TIER", "quick")  # quick and sampled sample the matrices
QUICK_CASES = int(os.environ.get("COMMLIB_MATRIX_QUICK_CASES", "24"))

NUMPY = arrayimpl.IMPLS["numpy"]
HEADS, DIM = 6, 8
# (query heads, kv heads): kv heads below the Ulysses degree at 2-4 ranks
HEAD_COUNTS = {"mha": (HEADS, HEADS), "gqa": (HEADS, 2), "kv_below_degree": (HEADS, 1)}

FACTORS: Dict[str, Tuple[str, ...]] = {
    "api": ("core", "torch", "jax"),
    "algorithm": ("ring", "ulysses", "hybrid"),
    "layout": ("contiguous", "zigzag", "zigzag_docs", "balanced"),
    "method": ("auto", "ring", "allgather", "sparse"),
    "masking": ("none", "causal", "cu_seqlens", "window", "prefix_lm", "shared_prefix",
                "multimodal", "block_diagonal", "mask_mod", "joint_prefix"),
    "heads": tuple(HEAD_COUNTS),
    "dtype": ("float64", "float32", "bfloat16"),
    "length": ("divisible", "uneven"),
    "sinks": ("none", "learned"),
    "softcap": ("none", "capped"),
    # v's head size: q's, or narrower (multi-head latent attention: 192 and 128)
    "value_dim": ("same", "narrower"),
}
VALUE_DIMS = {"same": DIM, "narrower": 5}
# Gemma2's logit soft-cap, small enough to bend these inputs' scores (about
# N(0, 1) after the scale)
SOFTCAP = 1.5
# every entry point (api x algorithm) meets every layout and method
FULL = (("api", "algorithm", "layout", "method"),)

# (out, gradients) bounds on the error relative to max(1, |reference|):
# float64 at the rounding of a few sums; float32 and bfloat16 at 2-3x the
# largest measured (tests/mpi/test_attention_frameworks.py)
TOLERANCE = {"float64": (1e-10, 1e-10), "float32": (3e-5, 1.2e-4),
             "bfloat16": (1.5e-2, 3e-2)}
MASKS = ("prefix_lm", "shared_prefix", "multimodal", "block_diagonal", "mask_mod",
         "joint_prefix")


def cases(world: int) -> List[Dict[str, Any]]:
    """This tier's cases at ``world`` ranks (the same on every rank)."""
    every = covering.covering(FACTORS, full=FULL, seed=world)
    return every if TIER == "full" else covering.sample(every, QUICK_CASES, seed=world)


def case_id(case: Dict[str, Any]) -> str:
    """A case's id: its values in factor order (``covering`` keeps it)."""
    return "-".join(str(value) for value in case.values())


def length_of(case: Dict[str, Any], world: int) -> int:
    """Divisible by 2P (every layout's chunks equal), or not."""
    return 4 * world * (2 if world < 3 else 1) + (0 if case["length"] == "divisible" else 3)


def visibility(case: Dict[str, Any], length: int) -> Tuple[Dict[str, Any], np.ndarray]:
    """The attention keywords that express ``case["masking"]`` over
    ``length`` tokens, and its dense boolean mask [s, s] (True = visible),
    written from the definition for the reference."""
    kind = case["masking"]
    if kind in MASKS:
        mask = _mask(kind, length)
        return {"mask": mask}, mask.dense()
    third = length // 3
    cu_seqlens = [0, third, 2 * third + 1, length] if kind == "cu_seqlens" else None
    window = (3, 0) if kind == "window" else None
    causal = kind != "none"
    options: Dict[str, Any] = {"causal": causal}
    if window is not None:
        options["window"] = window
    if cu_seqlens is None and case["length"] == "uneven":
        cu_seqlens = [0, length]  # the documented way to shard one uneven sequence
    if cu_seqlens is not None:
        options["cu_seqlens"] = cu_seqlens
    return options, document_mask(length, cu_seqlens, causal, window)


def _mask(kind: str, length: int) -> masks.Mask:
    if kind == "prefix_lm":
        return common_masks.prefix_lm(length, length // 3)
    if kind == "shared_prefix":
        return common_masks.shared_prefix(length, length // 4, 2)
    if kind == "multimodal":
        return common_masks.multimodal(length, [(2, 6)])
    if kind == "block_diagonal":
        return common_masks.block_diagonal(length, 3, causal=True)
    if kind == "joint_prefix":
        return _joint_prefix(length)
    return masks.from_mask_mod(lambda b, h, q, k: (k <= q) & (q - k < 5), length, block=4)


def _joint_prefix(length: int, text: int = 3) -> masks.Mask:
    """Joint text + image attention with the text kept whole on two ranks
    (commlib.bindings.diffusers' ``text="whole"``): [text | image half |
    text copy | image rest]; every query sees every image token and the
    first text copy only (the second would count each text key twice)."""
    half = (length - 2 * text) // 2
    copy = text + half
    every = (0, length)
    return masks.Mask([masks.Slice(every, (0, copy)), masks.Slice(every, (copy + text, length))],
                      length=length)


def expected_refusal(case: Dict[str, Any]) -> Optional[str]:
    """What a refused case's error must say, or None: the case computes.
    Each refusal is a documented limit with its way out, not a gap."""
    if case["layout"] == "balanced" and case["masking"] not in MASKS:
        return "pass mask="
    return None


def ulysses_degree(world: int) -> int:
    """The hybrid's Ulysses degree: a ring of 2 groups where the world is
    even, else Ulysses over all ranks."""
    return world // 2 if world % 2 == 0 else world


def inputs(case: Dict[str, Any], length: int, seed: int) -> List[np.ndarray]:
    """q, k, v, dout of the whole sequence, float64, rounded to the case's
    dtype (so the reference sees what the ranks see)."""
    import ml_dtypes
    rng = np.random.default_rng(seed)
    heads, kv_heads = HEAD_COUNTS[case["heads"]]
    value_dim = VALUE_DIMS[case.get("value_dim", "same")]
    shapes = ((heads, DIM), (kv_heads, DIM), (kv_heads, value_dim), (heads, value_dim))
    arrays = [rng.standard_normal((1, length, h, d)) for h, d in shapes]
    if case["dtype"] == "bfloat16":
        arrays = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in arrays]
    elif case["dtype"] == "float32":
        arrays = [x.astype(np.float32).astype(np.float64) for x in arrays]
    return arrays


def sinks_of(case: Dict[str, Any], seed: int) -> Optional[np.ndarray]:
    """The case's attention sinks [heads] (float64, rounded to its dtype),
    or None: near the scores' log-sum-exp, so that they take a real share."""
    if case["sinks"] == "none":
        return None
    import ml_dtypes
    sinks = np.random.default_rng(seed + 1).normal(1.5, 1.0, HEAD_COUNTS[case["heads"]][0])
    rounded = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}.get(case["dtype"])
    return sinks if rounded is None else sinks.astype(rounded).astype(np.float64)


def softcap_of(case: Dict[str, Any]) -> Optional[float]:
    """The case's cap on the scores, or None."""
    return SOFTCAP if case.get("softcap", "none") == "capped" else None


def reference(full: List[np.ndarray], dense: np.ndarray, sinks: Optional[np.ndarray],
              softcap: Optional[float] = None) -> List[np.ndarray]:
    """(out, dq, dk, dv, and dsinks with sinks) on the unsharded sequence,
    float64: torch SDPA, or the eager softmax written out (with the sink
    column, of the capped scores)."""
    if sinks is None and softcap is None:
        return masked_torch_reference(*full, dense)
    return eager_reference(*full, dense, sinks=sinks, softcap=softcap)


def run_case(case: Dict[str, Any], comm, full: List[np.ndarray], options: Dict[str, Any],
             sinks: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """(out, dq, dk, dv) of the whole sequence, float64, from ``case``'s
    entry point on every rank; with ``sinks``, dsinks after them, every
    rank's share summed."""
    layout = case["layout"]
    shard_keys = {key: options[key] for key in ("cu_seqlens", "mask") if key in options}
    mine = [ring.shard_sequence(x, comm, layout=layout, **shard_keys) for x in full]
    if sinks is not None:
        mine.append(sinks)
    call = dict(options, layout=layout)
    call.setdefault("causal", False)  # a mask says it all: causal=False beside it
    if softcap_of(case) is not None:
        call["softcap"] = softcap_of(case)
    if case["algorithm"] != "ulysses":
        call["method"] = case["method"]
    if case["algorithm"] == "hybrid":
        call["ulysses_size"] = ulysses_degree(comm.size)
    run = {"core": _core, "torch": _torch, "jax": _jax}[case["api"]]
    got = run(case["algorithm"], mine, case["dtype"], comm, call)
    whole = [ring.unshard_sequence(np.asarray(x, np.float64), comm, layout=layout, **shard_keys,
                                   length=full[0].shape[1] if not shard_keys else None)
             for x in got[:4]]
    return whole + [comm.allreduce(np.ascontiguousarray(dsinks)) for dsinks in got[4:]]


def _core(algorithm: str, mine: List[np.ndarray], dtype: str, comm,
          call: Dict[str, Any]) -> List[np.ndarray]:
    """The core functions on NumPy arrays (bfloat16 through ml_dtypes)."""
    q, k, v, dout, *sinks = (NUMPY.asarray(x, dtype) for x in mine)
    call = dict(call, sinks=sinks[0] if sinks else None)
    if algorithm == "ring":
        out, lse = ring.ring_attention(q, k, v, comm, return_lse=True, **call)
        grads = ring.ring_attention_backward(dout, q, k, v, out, lse, comm, **call)
    elif algorithm == "ulysses":
        out, lse = ulysses_attention(q, k, v, comm, return_lse=True, **call)
        grads = ulysses_attention_backward(dout, q, k, v, out, lse, comm, **call)
    else:
        degree = call.pop("ulysses_size")
        out, lse = hybrid_attention(q, k, v, comm, degree, return_lse=True, **call)
        grads = hybrid_attention_backward(dout, q, k, v, out, lse, comm, degree, **call)
    return [_float64(NUMPY, x) for x in (out, *grads)]


def _torch(algorithm: str, mine: List[np.ndarray], dtype: str, comm,
           call: Dict[str, Any]) -> List[np.ndarray]:
    """The torch binding, through autograd."""
    from commlib.bindings import torch as ct
    torch_impl = arrayimpl.IMPLS["torch"]
    q, k, v, dout, *sinks = (torch_impl.asarray(x, dtype) for x in mine)
    learned = [q, k, v] + sinks
    for x in learned:
        x.requires_grad_()
    call = dict(call, sinks=sinks[0] if sinks else None)
    args = (call.pop("ulysses_size"),) if algorithm == "hybrid" else ()
    out = getattr(ct, f"{algorithm}_attention")(q, k, v, comm, *args, **call)
    out.backward(dout)
    return [_float64(torch_impl, x) for x in [out] + [x.grad for x in learned]]


def _jax(algorithm: str, mine: List[np.ndarray], dtype: str, comm,
         call: Dict[str, Any]) -> List[np.ndarray]:
    """The JAX binding inside ``jax.jit``, through ``jax.vjp`` (float64
    with x64 on for this call)."""
    import jax

    from commlib.bindings import jax as cj
    call = dict(call)
    args = (call.pop("ulysses_size"),) if algorithm == "hybrid" else ()
    attention = getattr(cj, f"{algorithm}_attention")

    def step(q, k, v, dout, *sinks):
        def attend(q, k, v, *sinks):
            return attention(q, k, v, comm, *args, sinks=sinks[0] if sinks else None, **call)
        out, pullback = jax.vjp(attend, q, k, v, *sinks)
        return (out, *pullback(dout))

    jax_impl = arrayimpl.IMPLS["jax"]
    with _x64("jax", dtype):
        got = jax.jit(step)(*(jax_impl.asarray(x, dtype) for x in mine))
        return [_float64(jax_impl, x) for x in got]


# The inference core: decode (new tokens every rank holds) and a chunk's
# prefill (its queries sharded) over a KV cache striped by position, in each
# framework's eager arrays (JAX inside jit is not served by this core).
INFERENCE_FACTORS: Dict[str, Tuple[str, ...]] = {
    "entry": ("decode", "chunk"),
    "framework": ("numpy", "torch", "jax"),
    "method": ("auto", "pass_q", "pass_kv"),
    "masking": ("none", "causal", "window"),
    "heads": tuple(HEAD_COUNTS),
    "dtype": ("float64", "float32", "bfloat16"),
    "sinks": ("none", "learned"),
    "softcap": ("none", "capped"),
    "value_dim": ("same", "narrower"),
}
INFERENCE_FULL = (("entry", "framework", "method"),)
CACHED, NEW = 13, 5  # tokens in the cache, then new (decode) or a chunk's


def inference_cases(world: int) -> List[Dict[str, Any]]:
    every = covering.covering(INFERENCE_FACTORS, full=INFERENCE_FULL, seed=world)
    return every if TIER == "full" else covering.sample(every, QUICK_CASES // 2, seed=world)


def inference_visibility(case: Dict[str, Any]) -> Dict[str, Any]:
    return {"causal": case["masking"] != "none",
            "window": (4, 0) if case["masking"] == "window" else None}


def run_inference_case(case: Dict[str, Any], comm, full: List[np.ndarray],
                       sinks: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(this rank's output as float64, the positions of its queries): the
    cache holds positions p with p % P == rank; decode asks the last NEW
    positions on every rank, a chunk gives each rank a contiguous share of
    them."""
    from commlib.inference import chunk_attention, decode_attention
    q, k, v = full[:3]
    total = q.shape[1]
    keys = np.arange(comm.rank, total, comm.size)
    new = np.arange(total - NEW, total)
    asked = new if case["entry"] == "decode" else np.array_split(new, comm.size)[comm.rank]
    impl = arrayimpl.IMPLS[case["framework"]]
    options = dict(inference_visibility(case), q_positions=asked, k_positions=keys,
                   softcap=softcap_of(case))
    if case["entry"] == "chunk":
        options["method"] = case["method"]
    attention = decode_attention if case["entry"] == "decode" else chunk_attention
    with _x64(case["framework"], case["dtype"]):
        if sinks is not None:
            options["sinks"] = impl.asarray(sinks, case["dtype"])
        out = attention(*(impl.asarray(x, case["dtype"]) for x in (q[:, asked], k[:, keys],
                                                                    v[:, keys])),
                        comm, **options)
        return _float64(impl, out), asked


def _float64(impl: Any, x: Any) -> np.ndarray:
    return impl.to_numpy(x).astype(np.float64)


def _x64(framework: str, dtype: str):
    """JAX's float64 switched on for a float64 case (JAX has no float64
    arrays without it); nothing for the other frameworks."""
    import contextlib
    if framework != "jax":
        return contextlib.nullcontext()
    import jax
    return jax.enable_x64(dtype == "float64")
