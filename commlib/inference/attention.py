"""Attention over a KV cache sharded by position (``commlib.inference.cache``):
decode, and the prefill of a new chunk against the cache.

Decode (``decode_attention``): the t new tokens' queries are on every rank
(the model runs replicated past the prefill). Each rank attends them to
its own shard of the cache; the partial (out, lse) travel in one
all-gather of the small partials, and every rank merges them in one pass
(``merge_all``: the same operations on the same bytes everywhere), so every
rank gets the same result, bit for bit, and no K or V moves
(SGLang's and vLLM's decode context parallelism).

A chunk against the cache (``chunk_attention``, a second turn of a
conversation): the chunk's tokens are sharded (each rank holds its queries
and, in its cache, its share of the chunk's keys). Two ways, by Meta's
context-parallel inference:

- **pass-KV**: every rank's keys and values travel around the ring, as in
  Ring Attention: each rank moves (P-1)/P of the whole cache.
- **pass-Q**: the queries travel instead: an all-gather gives every rank
  every query, each rank attends them all to its own keys, and an
  all-to-all returns each rank's partials for its queries, which it merges.
  Each rank moves (P-1)/P of the chunk's queries and partial outputs.

``method="auto"`` picks the one that moves fewer bytes (``prefill_bytes``):
pass-Q when the chunk is short against the cache, pass-KV when it is not
(the crossover at a new/cached ratio near kv_heads / heads: GQA favours
pass-KV less). The attention is the same either way.

Masks are by global position: causal, and a window (left, right); keys and
queries of a rank come in increasing positions, so each query's keys are one
range of the shard (``visibility.band_blocks``).
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..kernels import Kernel
from ..kernels.merge import merge_all
from ..kernels.sinks import apply_sinks, check_sinks, sinks_fact
from ..namespace import accumulated, accumulator_dtype, detached, device, framework, namespace
from ..ring.exchange import RingExchange
from ..sequence.attention_call import agree_on_inputs, check_qkv, kernel_of, scale_of
from ..sequence.blockwise import attend, finish
from ..sequence.kv import joined, split
from ..sequence.options import AttentionOptions
from ..sequence.visibility import band_blocks, bounds

__all__ = ["decode_attention", "chunk_attention", "prefill_bytes", "PREFILL_METHODS"]

PREFILL_METHODS = ("auto", "pass_q", "pass_kv")


def decode_attention(q: Any, k: Any, v: Any, comm, *, q_positions: Sequence[int],
                     k_positions: Sequence[int], causal: bool, window: Any = None,
                     softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None,
                     return_lse: bool = False, sinks: Any = None,
                     softcap: Optional[float] = None):
    """Attention of new tokens, the same on every rank, over a sharded cache.

    q [b, t, h, d]: the new tokens' queries, identical on every rank, at
    global ``q_positions`` [t]; k, v [b, n, hk, d]: this rank's shard of the
    cache (the new tokens' own keys included, where this rank keeps them),
    at global ``k_positions`` [n], increasing. Query at p sees the key at r
    when r <= p (``causal``) and inside ``window`` = (left, right). Returns
    out [b, t, h, d] in q's framework, device and dtype, the same on every
    rank (and lse [b, h, t] float32, float64 for float64 q, with
    ``return_lse``). ``sinks`` [h]: attention sinks as ``ring_attention``'s,
    applied once, after every rank's partial is merged; ``softcap`` as
    ``ring_attention``'s.

    Positions given as arrays of q's framework (not NumPy: a torch, CuPy
    or JAX array, on q's device) take the path a captured or compiled
    decode step needs, which reads nothing back from the device: the
    visible keys are a mask made on the device, so the cache may be a
    preallocated buffer whose empty slots have position -1 (in any order),
    and the queries' positions are compared across ranks on the device
    (``_decode_on_device``)."""
    options = AttentionOptions(causal=causal, window=window, softmax_scale=softmax_scale,
                               softcap=softcap, kernel=kernel)
    out, lse = decode_attention_with(options, q, k, v, comm, q_positions=q_positions,
                                     k_positions=k_positions, sinks=sinks)
    return (out, lse) if return_lse else out


def decode_attention_with(options: AttentionOptions, q: Any, k: Any, v: Any, comm, *,
                          q_positions: Sequence[int], k_positions: Sequence[int],
                          sinks: Any = None) -> Tuple[Any, Any]:
    """(out, lse) of ``decode_attention`` with its options as one value
    (what the bindings call)."""
    q, k, v, sinks = detached(q, k, v, sinks)
    if _device_positions(q, q_positions) or _device_positions(q, k_positions):
        return _decode_on_device(options, q, k, v, comm, q_positions, k_positions, sinks)
    kernel, scale, (lo, hi) = _prepare(comm, "decode_attention", q, k, v, options, q_positions,
                                       k_positions, sinks, replicated=True)
    xp = namespace(q)
    state = attend(kernel, q, k, v, band_blocks(q_positions, k_positions, lo, hi), scale)
    out, lse = finish(state, q, value_dim=v.shape[-1]) if state is None else state
    (b, t, h, _), d = q.shape, v.shape[-1]
    packed = xp.concat([xp.reshape(accumulated(out, q), (-1,)), xp.reshape(lse, (-1,))])
    gathered = xp.reshape(comm.allgather(packed), (comm.size, -1))
    merged = merge_all(xp.reshape(gathered[:, :b * t * h * d], (comm.size, b, t, h, d)),
                       xp.reshape(gathered[:, b * t * h * d:], (comm.size, b, h, t)))
    return finish(merged, q, sinks, v.shape[-1])


def _device_positions(q: Any, positions: Any) -> bool:
    """Whether ``positions`` is an array of q's framework other than NumPy
    (a host sequence or a NumPy array takes the host path)."""
    kind = framework(q)
    return kind != "numpy" and _framework_or_none(positions) == kind


def _framework_or_none(x: Any) -> Optional[str]:
    try:
        return framework(x)
    except TypeError:
        return None


def _decode_on_device(options: AttentionOptions, q: Any, k: Any, v: Any, comm,
                      q_positions: Any, k_positions: Any, sinks: Any) -> Tuple[Any, Any]:
    """``decode_attention`` with positions on the device, and no read of
    the device: what is checked is what the host knows (shapes, dtypes,
    settings, agreed by every rank as on the host path); the keys a query
    sees are a device mask [t, n] (a key at a negative position: an empty
    slot, seen by none); the queries' positions travel with the partials,
    and a rank whose positions differ from rank 0's makes the output NaN on
    every rank (no rank can raise without reading the device)."""
    xp = namespace(q)
    problem = band = kernel = None
    try:
        check_qkv(q, k, v, same_length=False)
        check_sinks(sinks, q)
        options.check()
        q_positions = _on_device_as_ints("q_positions", q_positions, q.shape[1], q)
        k_positions = _on_device_as_ints("k_positions", k_positions, k.shape[1], q)
        band = bounds(options.causal, options.window)
        kernel = kernel_of(options, q)
    except ValueError as error:
        problem = error
    shared = dict(options.facts(), scale=None if problem else scale_of(q, options.softmax_scale),
                  kernel=None if options.kernel is None else options.kernel.name,
                  positions="device", q_length=None if problem else q.shape[1],
                  sinks=sinks_fact(sinks))
    agree_on_inputs(comm, "decode_attention", q, k, problem, shared_axes=(0, 2, 3), **shared)
    lo, hi = band
    wide = accumulator_dtype(q)
    (b, t, h, _), d = q.shape, v.shape[-1]
    if k.shape[1]:
        apart = q_positions[:, None] - k_positions[None, :]
        visible = (k_positions >= 0)[None, :] & (apart >= lo) & (apart <= hi)
        out, lse = kernel.forward(q, k, v, False, shared["scale"], mask=visible)
        out = xp.astype(out, wide, copy=False)
        lse = xp.astype(lse, wide, copy=False)
        # a row that saw no key: out 0 (a kernel may leave NaN there), lse -inf
        out = xp.where(xp.permute_dims(lse, (0, 2, 1))[..., None] == -math.inf, 0.0, out)
    else:
        out, lse = finish(None, q, value_dim=d)
        out = accumulated(out)
    packed = xp.concat([xp.reshape(out, (-1,)), xp.reshape(lse, (-1,)),
                        xp.astype(q_positions, wide)])
    gathered = xp.reshape(comm.allgather(packed), (comm.size, -1))
    merged = merge_all(
        xp.reshape(gathered[:, :b * t * h * d], (comm.size, b, t, h, d)),
        xp.reshape(gathered[:, b * t * h * d:b * t * h * (d + 1)], (comm.size, b, h, t)))
    told = gathered[:, b * t * h * (d + 1):]
    same = xp.all(told == told[:1])
    out, lse = apply_sinks(*merged, sinks)
    return xp.astype(xp.where(same, out, math.nan), q.dtype), xp.where(same, lse, math.nan)


def _on_device_as_ints(name: str, positions: Any, count: int, q: Any) -> Any:
    """``positions`` as a 1-D integer array of q's framework on q's device
    (a host sequence copied there), checked by what the host knows: its
    shape and dtype; never its values."""
    xp = namespace(q)
    if _framework_or_none(positions) != framework(q):
        positions = xp.asarray(np.asarray(positions, np.int64), device=device(q))
    if len(positions.shape) != 1 or not xp.isdtype(positions.dtype, "integral"):
        raise ValueError(f"{name} must be a 1-D array of integer positions, got shape "
                         f"{tuple(positions.shape)} of {positions.dtype}")
    if positions.shape[0] != count:
        raise ValueError(f"{name} has {positions.shape[0]} positions for {count} tokens")
    return xp.astype(positions, xp.int64, copy=False)


def chunk_attention(q: Any, k: Any, v: Any, comm, *, q_positions: Sequence[int],
                    k_positions: Sequence[int], causal: bool, window: Any = None,
                    softmax_scale: Optional[float] = None, kernel: Optional[Kernel] = None,
                    method: str = "auto", return_lse: bool = False, sinks: Any = None,
                    softcap: Optional[float] = None):
    """Attention of this rank's queries of a new chunk over the whole
    sharded cache (the chunk's keys included: every rank stores its share
    first).

    q [b, m, h, d]: this rank's queries at global ``q_positions`` [m];
    k, v [b, n, hk, d]: this rank's shard of the cache at ``k_positions``
    [n]; both increasing; m and n may differ across ranks. ``method``:
    "pass_kv", "pass_q" or "auto" (fewer bytes, ``prefill_bytes``; the same
    choice on every rank). Returns out [b, m, h, d] in q's framework,
    device and dtype (and lse [b, h, m] float32, float64 for float64 q,
    with ``return_lse``); ``sinks`` and ``softcap`` as ``decode_attention``'s."""
    options = AttentionOptions(causal=causal, window=window, softmax_scale=softmax_scale,
                               softcap=softcap, kernel=kernel, method=method)
    out, lse = chunk_attention_with(options, q, k, v, comm, q_positions=q_positions,
                                    k_positions=k_positions, sinks=sinks)
    return (out, lse) if return_lse else out


def chunk_attention_with(options: AttentionOptions, q: Any, k: Any, v: Any, comm, *,
                         q_positions: Sequence[int], k_positions: Sequence[int],
                         sinks: Any = None) -> Tuple[Any, Any]:
    """(out, lse) of ``chunk_attention`` with its options as one value
    (what the bindings call)."""
    q, k, v, sinks = detached(q, k, v, sinks)
    kernel, scale, band = _prepare(comm, "chunk_attention", q, k, v, options, q_positions,
                                   k_positions, sinks, replicated=False)
    queries, keys = _everyone(comm, q_positions), _everyone(comm, k_positions)
    method = options.method
    if method == "auto":
        costs = prefill_bytes([len(p) for p in queries], [len(p) for p in keys], q.shape[0],
                              q.shape[2], k.shape[2], q.shape[3], q.dtype.itemsize,
                              value_dim=v.shape[3])
        method = min(costs, key=lambda name: (costs[name], name != "pass_kv"))
    run = _pass_q if method == "pass_q" else _pass_kv
    return finish(run(comm, kernel, scale, band, q, k, v, queries, keys), q, sinks, v.shape[-1])


def prefill_bytes(queries: Sequence[int], keys: Sequence[int], batch: int, num_heads: int,
                  num_kv_heads: int, head_dim: int, itemsize: int, *,
                  value_dim: Optional[int] = None) -> Dict[str, int]:
    """Bytes each rank sends to attend a chunk whose queries sit ``queries[r]``
    on rank r, over a cache of ``keys[r]`` keys on rank r. pass-KV: every
    rank's K and V, padded to the largest shard, around the ring (P-1 hops);
    pass-Q: every rank's queries to everyone (padded alike), and each
    query's partial (out and lse, float32; float64 for float64 inputs) back
    to its rank. ``value_dim``: v's head size where it differs from q's and
    k's ``head_dim`` (multi-head latent attention)."""
    size = len(queries)
    hops = size - 1
    value_dim = head_dim if value_dim is None else value_dim
    return {"pass_kv": hops * max(keys) * batch * num_kv_heads * (head_dim + value_dim)
            * itemsize,
            "pass_q": hops * max(queries) * batch * num_heads * (head_dim * itemsize
                                                           + max(4, itemsize) * (value_dim + 1))}


def _prepare(comm, op: str, q: Any, k: Any, v: Any, options: AttentionOptions,
             q_positions: Sequence[int], k_positions: Sequence[int], sinks: Any,
             replicated: bool) -> Tuple[Kernel, float, Tuple[int, int]]:
    """Check this rank's inputs and agree with every rank (any problem
    raises on all): the shapes but the cache's length, the dtype, the
    options, the sinks' presence, shape and dtype, and, for ``replicated``
    queries, their positions. Returns the kernel (bound to the options'
    cap), the scale and the visible distances."""
    problem = band = kernel = None
    try:
        check_qkv(q, k, v, same_length=False)
        check_sinks(sinks, q)
        options.check()
        _check_positions("q_positions", q_positions, q.shape[1])
        _check_positions("k_positions", k_positions, k.shape[1])
        band = bounds(options.causal, options.window)
        if options.method not in PREFILL_METHODS:
            raise ValueError(f"method must be one of {', '.join(PREFILL_METHODS)}, got "
                             f"{options.method!r}")
        kernel = kernel_of(options, q)
    except ValueError as error:
        problem = error
    shared = dict(options.facts(), scale=None if problem else scale_of(q, options.softmax_scale),
                  kernel=None if options.kernel is None else options.kernel.name,
                  sinks=sinks_fact(sinks))
    if replicated:  # the same new tokens everywhere
        shared["q_length"] = q.shape[1] if problem is None else None
        shared["q_positions"] = zlib.crc32(np.asarray(q_positions, np.int64).tobytes()) \
            if problem is None else None
    # the shards' lengths differ across ranks: batch, heads and head_dim agree
    agree_on_inputs(comm, op, q, k, problem, shared_axes=(0, 2, 3), **shared)
    return kernel, shared["scale"], band


def _check_positions(name: str, positions: Sequence[int], count: int) -> None:
    """``positions``: ``count`` increasing non-negative integers."""
    try:
        values = np.asarray(positions)
    except Exception:
        values = None
    if values is None or values.ndim != 1 or (values.size and not np.issubdtype(
            values.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D sequence of integer positions, got "
                         f"{type(positions).__name__}")
    if values.size != count:
        raise ValueError(f"{name} has {values.size} positions for {count} tokens")
    if values.size and (values[0] < 0 or np.any(np.diff(values) <= 0)):
        raise ValueError(f"{name} must be non-negative and increasing (a shard's tokens in "
                         f"sequence order), got {values[:8].tolist()}")


def _everyone(comm, positions: Sequence[int]) -> List[np.ndarray]:
    """Every rank's ``positions`` (host int64), rank by rank: two small
    all-gathers (the counts, then the positions padded to the longest)."""
    mine = np.asarray(positions, np.int64)
    counts = np.asarray(comm.allgather(np.array([mine.size], np.int64)))
    padded = np.zeros(int(counts.max(initial=0)), np.int64)
    padded[:mine.size] = mine
    everyone = np.asarray(comm.allgather(padded)).reshape(comm.size, -1)
    return [everyone[r, :int(n)] for r, n in enumerate(counts)]


def _padded(x: Any, length: int) -> Any:
    """``x`` [b, n, ...] with zero rows appended along axis 1 to ``length``."""
    xp = namespace(x)
    if x.shape[1] == length:
        return x
    pad = xp.zeros((x.shape[0], length - x.shape[1]) + tuple(x.shape[2:]), dtype=x.dtype,
                   device=device(x))
    return xp.concat([x, pad], axis=1)


def _pass_kv(comm, kernel, scale, band, q, k, v, queries, keys):
    """The merged state (``blockwise.attend``'s) of the cache's K and V
    around the ring, against this rank's queries."""
    longest = max(len(p) for p in keys)
    block = joined(_padded(k, longest), _padded(v, longest))
    mine = queries[comm.rank]
    state = None
    for source, arrived in RingExchange(comm).rotate(block):
        count = len(keys[source])
        arrived_k, arrived_v = split(arrived[:, :, :count], k.shape[-1])
        state = attend(kernel, q, arrived_k, arrived_v,
                       band_blocks(mine, keys[source], *band), scale, state)
    return state


def _pass_q(comm, kernel, scale, band, q, k, v, queries, keys):
    """Every query to every rank, its partial over each rank's keys back:
    the merged state, as ``_pass_kv``'s."""
    xp = namespace(q)
    b, _, h, d = q.shape
    value_dim = v.shape[-1]
    longest = max(len(p) for p in queries)
    everyone = xp.reshape(comm.allgather(_padded(q, longest)), (comm.size, b, longest, h, d))
    partials = []
    for source, positions in enumerate(queries):
        asked = everyone[source][:, :len(positions)]
        state = attend(kernel, asked, k, v, band_blocks(positions, keys[comm.rank], *band),
                       scale)
        out, lse = finish(state, asked, value_dim=value_dim) if state is None else state
        out = _padded(accumulated(out, q), longest)
        lse = xp.permute_dims(_padded(xp.permute_dims(lse, (0, 2, 1)), longest), (0, 2, 1))
        partials.append(xp.concat([xp.reshape(out, (-1,)), xp.reshape(lse, (-1,))]))
    received = comm.alltoall(xp.stack(partials))  # row r: rank r's partial for my queries
    count = len(queries[comm.rank])
    size = comm.size
    values = b * longest * h * value_dim
    return merge_all(
        xp.reshape(received[:, :values], (size, b, longest, h, value_dim))[:, :, :count],
        xp.reshape(received[:, values:], (size, b, h, longest))[..., :count])
