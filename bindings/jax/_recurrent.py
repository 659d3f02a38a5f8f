"""Context-parallel Gated DeltaNet and Mamba2 mixers for JAX, usable inside
``jax.jit`` and differentiable with ``jax.grad``.

The decomposition is the torch mixers' (``bindings/torch/_recurrent.py``):
each piece of the shard runs its chunked scan once from a zero state and
also yields the readout of the incoming state per token and its map
``state out = transition ∘ state in + offset``; ``incoming_state`` composes
the maps across ranks (one traced all-gather of O(state) bytes); each piece
then adds ``readout · state in`` to its outputs. The local scans are jnp
(``lax.scan`` over chunks), differentiated by JAX; only the collectives
carry custom VJPs (``bindings/jax/_recurrent_state.py``). Unlike the torch
mixers, a shard's pieces of one length run as one pass (stacked on a
leading axis: zigzag's two pieces), padding pieces do not run (their
outputs, transition and offset are zeros, read by nobody), and a document
start inside a piece zeroes the decays across it instead of cutting the
pass: one scan to compile per piece length, whatever the documents. The
checks and the piece layout are agreed by every rank when JAX traces, so
bad input raises on every rank; piece boundaries and document starts are static (a new
``cu_seqlens`` traces a new program). Computed in the inputs' dtype where it
is float32 or float64 (float64 needs ``jax_enable_x64``), in float32 for
16-bit inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from commlib.namespace import accumulator_dtype
from commlib.recurrent.mixer_inputs import delta_rule_facts, mamba2_facts, sequence_length
from commlib.recurrent.mixer_pieces import Run, runs

from ._recurrent_state import incoming_state, summed_over_ranks
from ._traced_comm import traced

__all__ = ["gated_delta_rule", "mamba2_scan"]


@dataclass
class _Pieces:
    """Pieces of one length (stacked on axis 0), each run from a zero state:
    outputs, the readout of the incoming state per token, and the map
    ``state out = transition ∘ state in + offset``."""

    out: Any         # [P, B, L, H, d_v] (delta rule) or [P, B, L, H, headdim] (Mamba2)
    readout: Any     # [P, B, L, H, d_k] or [P, B, L, H, dstate]
    transition: Any  # [P, B, H, d_k, d_k] matrix, or [P, B, H] scalar decay
    offset: Any      # the state: [P, B, H, d_k, d_v] or [P, B, H, headdim, dstate]


def _padded(x, axis: int, pad: int):
    """``x`` with ``pad`` zeros appended along ``axis`` (NumPy stays NumPy:
    the resets are static)."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return (np if isinstance(x, np.ndarray) else jnp).pad(x, widths)


def _each_piece(scan: Callable, found: List[Run], inputs: List[Any]) -> List[tuple]:
    """(out, readout, transition, offset) of each piece, in shard order:
    ``scan(*stacked inputs, runs)`` once per piece length over the pieces of
    that length (inputs [B, L, ...] sliced along axis 1); padding pieces get
    zeros shaped like a real piece's (a shard of padding alone runs it)."""
    real = [i for i, r in enumerate(found) if not r.padding] or list(range(len(found)))
    by_length: dict = {}
    for i in real:
        by_length.setdefault(found[i].stop - found[i].start, []).append(i)
    made = {}
    for indices in by_length.values():
        group = [found[i] for i in indices]
        pieces = scan(*(jnp.stack([x[:, r.start:r.stop] for r in group]) for x in inputs), group)
        for j, i in enumerate(indices):
            made[i] = (pieces.out[j], pieces.readout[j], pieces.transition[j], pieces.offset[j])
    like = made[real[0]]

    def zeros(r: Run) -> tuple:
        length = r.stop - r.start
        return tuple(jnp.zeros(x.shape[:1] + (length,) + x.shape[2:], x.dtype) for x in like[:2]) \
            + tuple(jnp.zeros_like(x) for x in like[2:])
    return [made[i] if i in made else zeros(r) for i, r in enumerate(found)]


def _reset_before(found: List[Run], shape: Tuple[int, ...]) -> np.ndarray:
    """[P, 1, ..., L] bool (``shape``'s ones between): the state is zeroed
    before these tokens of each piece (static; the pieces of one length)."""
    reset = np.zeros((len(found), found[0].stop - found[0].start), bool)
    for i, r in enumerate(found):
        reset[i, list(r.resets)] = True
    return reset.reshape((len(found),) + shape + (reset.shape[1],))


def _swapped(x):
    return jnp.swapaxes(x, -1, -2)


@dataclass
class _ChunkDecays:
    """The decays a chunked scan reads, each the exp of a sum of per-token
    log decays, and 0 across a reset (a document start zeroes the state, as
    a decay of 0 would): the only way the resets enter, so a piece holding
    several documents is one pass, not one per document."""

    pairwise: Any    # [..., n, c, c]: over (j, i] (i >= j, else 0)
    from_start: Any  # [..., n, c]: over [0, i]: the chunk's entering state read at i
    to_end: Any      # [..., n, c]: over (j, c): token j's part of the chunk's final state
    whole: Any       # [..., n]: over the chunk


def _chunk_decays(log_decay, reset: np.ndarray) -> _ChunkDecays:
    """``log_decay`` [..., n, c] per token, in chunks; ``reset`` (static,
    broadcasting to it): the state zeroed before these tokens."""
    within = np.cumsum(reset, axis=-1)  # resets seen in the chunk, up to each token
    size = reset.shape[-1]
    same = np.tril(np.ones((size, size), bool)) & (within[..., :, None] == within[..., None, :])
    cum = jnp.cumsum(log_decay, axis=-1)

    def kept(keep, exponent):
        return jnp.exp(jnp.where(keep, exponent, -jnp.inf))
    return _ChunkDecays(kept(same, cum[..., :, None] - cum[..., None, :]),
                        kept(within == 0, cum),
                        kept(within == within[..., -1:], cum[..., -1:] - cum),
                        kept(within[..., -1] == 0, cum[..., -1]))


def _chunked(x, axis: int, chunk_size: int):
    """``x`` padded with zeros along ``axis`` (negative) to whole chunks,
    that axis split into [chunks, chunk_size]."""
    x = _padded(x, axis, (-x.shape[axis]) % chunk_size)
    axis %= x.ndim
    return x.reshape(x.shape[:axis] + (-1, chunk_size) + x.shape[axis + 1:])


# ---- gated delta rule ------------------------------------------------------------------

def _delta_chunks(q, k, v, g, beta, chunk_size: int, reset: np.ndarray, state):
    """transformers' ``torch_chunk_gated_delta_rule`` scan (``lax.scan`` over
    chunks), the state zeroed before each token where ``reset``: q, k
    [..., L, d_k] (normalized and scaled), v [..., L, d_v], g, beta [..., L],
    state [..., d_k, d_v]. (out [..., L, d_v], final state)."""
    length = q.shape[-2]
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (_chunked(x, -2, chunk_size) for x in (q, k, k_beta, v_beta))
    decays = _chunk_decays(_chunked(g, -1, chunk_size), _chunked(reset, -1, chunk_size))
    system = (k_beta @ _swapped(k)) * decays.pairwise
    intra = (q @ _swapped(k)) * decays.pairwise

    def solve(rhs):
        return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True,
                                               unit_diagonal=True)
    new_values = solve(v_beta)
    k_cumdecay = solve(k_beta * decays.from_start[..., None])
    q = q * decays.from_start[..., None]
    k = k * decays.to_end[..., None]

    def step(state, chunk):
        q_i, k_i, intra_i, new_i, k_cumdecay_i, whole_i = chunk
        v_new = new_i - k_cumdecay_i @ state
        out = q_i @ state + intra_i @ v_new
        return state * whole_i[..., None, None] + _swapped(k_i) @ v_new, out

    chunks = tuple(jnp.moveaxis(x, -3, 0) for x in (q, k, intra, new_values, k_cumdecay)) + \
        (jnp.moveaxis(decays.whole, -1, 0),)
    state, outs = jax.lax.scan(step, state, chunks)
    out = jnp.moveaxis(outs, 0, -3)
    return out.reshape(out.shape[:-3] + (-1, v.shape[-1]))[..., :length, :], state


def _delta_inputs(query, key, value, g, beta, use_qk_l2norm_in_kernel: bool):
    """[P, B, L, H, d] pieces heads first ([P, B, H, L, d]; g, beta
    [P, B, H, L]), key heads repeated over their value heads, in the
    accumulator dtype, queries and keys normalized as the kernel does."""
    dtype = accumulator_dtype(query, key, value, g, beta)
    groups = value.shape[-2] // key.shape[-2]
    query, key = (jnp.repeat(x, groups, axis=-2) for x in (query, key))
    query, key, value = (jnp.swapaxes(x, -3, -2).astype(dtype) for x in (query, key, value))
    g, beta = (_swapped(x).astype(dtype) for x in (g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = (x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + 1e-6)
                      for x in (query, key))
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def _delta_rule_pieces(query, key, value, g, beta, found: List[Run], chunk_size: int,
                       use_qk_l2norm_in_kernel: bool) -> _Pieces:
    """The gated delta rule over stacked pieces from a zero state, reset
    before each piece's ``resets``: one pass with values ``[v | 0]`` from the
    state ``[0 | I]`` (see ``bindings.torch._recurrent``'s docstring). After
    a reset the ``I`` columns are zero, so the tokens there read no incoming
    state and the transition is 0, as the torch mixer sets them."""
    q, k, v, g, beta = _delta_inputs(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    d_k, d_v = k.shape[-1], v.shape[-1]
    lead = v.shape[:-2]  # P, B, H
    augmented = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (d_k,), v.dtype)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(d_k, dtype=v.dtype), lead + (d_k, d_k))
    state = jnp.concatenate([jnp.zeros(lead + (d_k, d_v), v.dtype), identity], axis=-1)
    out, state = _delta_chunks(q, k, augmented, g, beta, chunk_size,
                               _reset_before(found, (1, 1)), state)
    out = jnp.swapaxes(out, -3, -2)
    return _Pieces(out[..., :d_v], out[..., d_v:], state[..., d_v:], state[..., :d_v])


def _read_delta(readout, state):
    return jnp.einsum("...lhk,...hkv->...lhv", readout, state)


# ---- Mamba2 (SSD) ----------------------------------------------------------------------

def _rounded(x, dtype):
    """x (float32 or wider) rounded to ``dtype``'s precision, also inside
    ``jax.jit``, where XLA may keep a 16-bit result in float32."""
    info = jnp.finfo(dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _discretized_dt(dt, dt_bias, dt_softplus: bool, dt_limit: Tuple[float, float]):
    """Mamba2's time step as its scan uses it (bias, softplus, clamp), as
    torch computes it, so that the same steps land on ``dt_limit``'s bounds
    (often, in bfloat16): in float32, each step rounded to dt's dtype; the
    clamp with torch.clamp's gradient, 1 at the bounds (jnp.clip's is 0.5)."""
    dtype = dt.dtype
    dt = dt.astype(jnp.promote_types(dtype, jnp.float32))
    if dt_bias is not None:
        dt = _rounded(dt + _rounded(dt_bias.astype(dt.dtype), dtype), dtype)
    if dt_softplus:
        dt = _rounded(jax.nn.softplus(dt), dtype)
    dt = dt.astype(dtype)
    low, high = dt_limit
    return jnp.where(dt < low, low, jnp.where(dt > high, high, dt))


def _ssd_chunks(x, dt, A, B, C, chunk_size: int, reset: np.ndarray):
    """transformers' ``mamba2_chunk_scan`` without D, from a zero state, the
    chunks' states carried by ``lax.scan``, the state zeroed before each
    token where ``reset`` ([..., 1, L]): x [..., l, h, p], dt [..., l, h]
    (discretized), A [h], B, C [..., l, h, n]. (y [..., l, h, p], final
    state [..., h, p, n])."""
    length, heads, head_dim = x.shape[-3:]
    x, B, C = (_chunked(t, -3, chunk_size) for t in (x * dt[..., None], B, C))
    decays = _chunk_decays(_chunked(_swapped(A * dt), -1, chunk_size),
                           _chunked(reset, -1, chunk_size))  # [..., h, chunks, c(, c)]
    scores = jnp.einsum("...clhn,...cshn->...hcls", C, B) * decays.pairwise
    y_diag = jnp.einsum("...hcls,...cshp->...clhp", scores, x)
    ends = jnp.einsum("...clhn,...hcl,...clhp->...chpn", B, decays.to_end, x)

    def step(state, chunk):
        end, whole, C_i, from_start = chunk
        y_off = jnp.einsum("...lhn,...hpn,...hl->...lhp", C_i, state, from_start)
        return state * whole[..., None, None] + end, y_off

    chunks = (jnp.moveaxis(ends, -4, 0), jnp.moveaxis(decays.whole, -1, 0),
              jnp.moveaxis(C, -4, 0), jnp.moveaxis(decays.from_start, -2, 0))
    state, y_off = jax.lax.scan(step, jnp.zeros_like(ends[..., 0, :, :, :]), chunks)
    y = y_diag + jnp.moveaxis(y_off, 0, -4)
    return y.reshape(y.shape[:-4] + (-1, heads, head_dim))[..., :length, :, :], state


def _mamba2_pieces(hidden_states, dt, A, B, C, chunk_size: int, found: List[Run]) -> _Pieces:
    """Mamba2's SSD scan over stacked pieces (x [P, b, l, h, p], dt
    discretized) from a zero state, reset before each piece's ``resets``;
    without the D skip. Readout ``exp(A cumsum(dt)_t) C_t`` and transition
    ``exp(A Σ dt)``, 0 from the first reset on."""
    dtype = accumulator_dtype(hidden_states, dt, B, C)
    heads = hidden_states.shape[-2]
    x, dt, A = hidden_states.astype(dtype), dt.astype(dtype), A.astype(dtype)
    B, C = (jnp.repeat(t.astype(dtype), heads // t.shape[-2], axis=-2) for t in (B, C))
    reset = _reset_before(found, (1, 1))  # [P, 1, 1, L]
    out, offset = _ssd_chunks(x, dt, A, B, C, chunk_size, reset)
    unreset = np.swapaxes(np.cumsum(reset, axis=-1) == 0, -1, -2)  # [P, 1, L, 1]
    decay = jnp.cumsum(A * dt, axis=-2)  # [P, b, l, h]
    readout = jnp.exp(jnp.where(unreset, decay, -jnp.inf))[..., None] * C
    transition = jnp.exp(jnp.where(unreset[..., -1, :], decay[..., -1, :], -jnp.inf))
    return _Pieces(out, readout, transition, offset)


def _read_ssd(readout, state):
    return jnp.einsum("...lhn,...hpn->...lhp", readout, state)


# ---- sharded -----------------------------------------------------------------------------

def _applied(transition, state):
    """transition ∘ state (stacked alike): a matrix product, or a decay per
    (batch, head)."""
    if transition.ndim == state.ndim:
        return transition @ state
    return transition[..., None, None] * state


def _composed(made: List[tuple], found: List[Run], read: Callable, initial: Optional[Any],
              want_final: bool, comm, layout: str, cu_seqlens: Any):
    """The pieces' outputs (``_each_piece``'s) with their incoming states
    read in, in shard order, and the sequence's final state on every rank
    (or None). ``initial`` enters the piece that begins the sequence, to
    which the core gives a zero state; it reaches the later pieces through
    that piece's offset."""
    transitions = jnp.stack([piece[2] for piece in made])
    offsets = jnp.stack([piece[3] for piece in made])
    per_piece = (-1,) + (1,) * (offsets.ndim - 1)
    begins = jnp.asarray([run.begins for run in found], offsets.dtype).reshape(per_piece)
    if initial is not None:
        entering = begins * initial.astype(offsets.dtype)
        incoming = incoming_state(transitions, _applied(transitions, entering) + offsets, comm,
                                  layout=layout, cu_seqlens=cu_seqlens) + entering
    else:
        incoming = incoming_state(transitions, offsets, comm, layout=layout,
                                  cu_seqlens=cu_seqlens)
    out = jnp.concatenate([out + read(readout, incoming[i])
                           for i, (out, readout, _, _) in enumerate(made)], axis=1)
    if not want_final:
        return out, None
    ends = jnp.asarray([run.ends for run in found], offsets.dtype).reshape(per_piece)
    final = (ends * (_applied(transitions, incoming) + offsets)).sum(0)
    return out, summed_over_ranks(final, comm)


def gated_delta_rule(query, key, value, g, beta, comm, *, layout: str, chunk_size: int = 64,
                     cu_seqlens: Any = None, initial_state: Optional[Any] = None,
                     output_final_state: bool = False,
                     use_qk_l2norm_in_kernel: bool = False) -> Tuple[Any, Optional[Any]]:
    """``bindings.torch.gated_delta_rule`` for JAX arrays, jit-able and
    differentiable: transformers' ``torch_chunk_gated_delta_rule`` on a
    sequence sharded in ``layout`` (this rank's shard: q, k [B, L, H_k, d_k],
    v [B, L, H_v, d_v], g, beta [B, L, H_v]). ``cu_seqlens`` (concrete):
    documents restart from a zero state; ``initial_state`` [B, H_v, d_k, d_v]
    enters the sequence's first token. Returns (out in the query's dtype,
    the sequence's final state on every rank if ``output_final_state``, else
    None); every rank must use that state alike, its backward is collective."""
    found = runs(traced(comm), "gated_delta_rule", sequence_length(key), layout, cu_seqlens,
                 lambda: delta_rule_facts(query, key, value, g, beta, initial_state, chunk_size,
                                          output_final_state, use_qk_l2norm_in_kernel),
                 initial_state is not None)
    made = _each_piece(lambda *stacked: _delta_rule_pieces(*stacked, chunk_size,
                                                           use_qk_l2norm_in_kernel),
                       found, [query, key, value, g, beta])
    out, final = _composed(made, found, _read_delta, initial_state, output_final_state, comm,
                           layout, cu_seqlens)
    return out.astype(query.dtype), final


def mamba2_scan(hidden_states, dt, A, B, C, comm, *, layout: str, chunk_size: int = 256,
                D: Optional[Any] = None, dt_bias: Optional[Any] = None,
                initial_states: Optional[Any] = None, dt_softplus: bool = False,
                dt_limit: Tuple[float, float] = (0.0, float("inf")),
                return_final_states: bool = False, cu_seqlens: Any = None) -> Any:
    """``bindings.torch.mamba2_scan`` for JAX arrays, jit-able and
    differentiable: Mamba2's chunked SSD scan on a sequence sharded in
    ``layout`` (this rank's shard: x [b, l, h, p], dt [b, l, h] before
    bias/softplus/clamp, A [h], B, C [b, l, groups, n], D [h]).
    ``cu_seqlens`` (concrete): documents restart from a zero state;
    ``initial_states`` [b, h, p, n] enters the sequence's first token.
    Returns y in x's dtype, and with ``return_final_states`` (y, the
    sequence's final state on every rank; every rank must use it alike)."""
    found = runs(traced(comm), "mamba2_scan", sequence_length(hidden_states), layout, cu_seqlens,
                 lambda: mamba2_facts(hidden_states, dt, A, B, C, D, dt_bias, initial_states,
                                      chunk_size, dt_softplus, tuple(dt_limit),
                                      return_final_states),
                 initial_states is not None)
    dt = _discretized_dt(dt, dt_bias, dt_softplus, dt_limit)
    made = _each_piece(lambda x, dt, B, C, group: _mamba2_pieces(x, dt, A, B, C, chunk_size,
                                                                 group),
                       found, [hidden_states, dt, B, C])
    y, final = _composed(made, found, _read_ssd, initial_states, return_final_states, comm,
                         layout, cu_seqlens)
    if D is not None:
        y = y + D.astype(y.dtype)[:, None] * hidden_states.astype(y.dtype)
    y = y.astype(hidden_states.dtype)
    return (y, final) if return_final_states else y
