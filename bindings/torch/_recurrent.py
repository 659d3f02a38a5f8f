"""Context-parallel Gated DeltaNet and Mamba2 mixers in torch, differentiable.

Both recurrences are affine in the state that enters a stretch of tokens, so
each rank runs its shard's chunked algorithm once from a zero state and also
gets the stretch's map ``state out = T ∘ state in + O`` plus, per token, the
vector that reads the incoming state into the output (its *readout*).
``commlib.recurrent`` composes the maps across ranks (O(state) bytes, never
O(sequence)); each rank then adds ``readout · state in`` to its outputs.

- Gated delta rule: ``S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``,
  ``o_t = S_tᵀ q_t``. The state's columns evolve independently, so one
  chunked pass with values ``[v | 0]`` from the state ``[0 | I]`` gives the
  zero-start outputs and state ``O`` (first d_v columns), the prefix
  transitions read by the query, ``P_tᵀ q_t`` (last d_k output columns), and
  ``T = P_L`` (last d_k state columns): ``o_t = o⁰_t + S_inᵀ (P_tᵀ q_t)``.
- Mamba2 (SSD): ``h_t = exp(A dt_t) h_{t-1} + dt_t x_t B_tᵀ``, ``y_t = h_t C_t``:
  ``T = exp(A Σ dt)`` per head, readout ``exp(A cumsum(dt)_t) C_t``.

A document start inside a stretch resets the state: the tokens from there on
do not read the incoming state, and ``T`` is 0. Padding is a piece of its own
(``commlib.recurrent.pieces``), computed and read by nobody, so no padding
token enters a real state. Everything is computed in the inputs'
dtype where it is float32 or float64, in float32 for 16-bit inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from commlib.namespace import accumulator_dtype
from commlib.recurrent.mixer_inputs import delta_rule_facts, mamba2_facts, sequence_length
from commlib.recurrent.mixer_pieces import Run, runs

from ._recurrent_state import incoming_state

__all__ = ["gated_delta_rule", "mamba2_scan", "PieceScan", "delta_rule_piece", "mamba2_piece",
           "discretized_dt", "SummedOverRanks"]


@dataclass
class PieceScan:
    """A contiguous stretch of the sequence run from a zero state: its
    outputs, the readout of the incoming state per token, and its map
    ``state out = transition ∘ state in + offset``."""

    out: torch.Tensor         # [B, L, H, d_v] (delta rule) or [B, L, H, headdim] (Mamba2)
    readout: torch.Tensor     # [B, L, H, d_k] or [B, L, H, dstate]
    transition: torch.Tensor  # [B, H, d_k, d_k] matrix, or [B, H] scalar decay
    offset: torch.Tensor      # the state: [B, H, d_k, d_v] or [B, H, headdim, dstate]


def _segments(length: int, resets: Sequence[int]) -> List[Tuple[int, int]]:
    """The stretch cut at its document starts; the first segment (possibly
    empty) is the one that continues the incoming state."""
    cuts = sorted({0, length} | {int(r) for r in resets if 0 < r < length})
    if 0 in resets:
        cuts = [0] + cuts
    return list(zip(cuts[:-1], cuts[1:]))


# ---- gated delta rule ------------------------------------------------------------------

def _delta_chunks(q, k, v, g, beta, chunk_size: int, state):
    """transformers' ``torch_chunk_gated_delta_rule`` scan, in the inputs'
    dtype: q, k [B, H, L, d_k] (normalized and scaled), v [B, H, L, d_v],
    g, beta [B, H, L], state [B, H, d_k, d_v]. (out [B, H, L, d_v], final)."""
    length = q.shape[2]
    if length == 0:
        return v, state
    pad = (-length) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    cum = g.reshape(g.shape[0], g.shape[1], -1, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None],
                                               upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.cat(outs, dim=2)[:, :, :length]
    return out, state


def _delta_inputs(query, key, value, g, beta, use_qk_l2norm_in_kernel: bool):
    """Heads first, key heads repeated over their value heads, in the
    accumulator dtype, queries and keys normalized as the kernel does."""
    dtype = accumulator_dtype(query, key, value, g, beta)
    groups = value.shape[2] // key.shape[2]
    query, key = (x.repeat_interleave(groups, dim=2) for x in (query, key))
    query, key, value, g, beta = (x.transpose(1, 2).to(dtype) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (query, key))
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def delta_rule_piece(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, *, chunk_size: int = 64,
                     resets: Sequence[int] = (),
                     use_qk_l2norm_in_kernel: bool = False) -> PieceScan:
    """The gated delta rule over a stretch (transformers' tensors: q, k
    [B, L, H_k, d_k], v [B, L, H_v, d_v], g, beta [B, L, H_v]) from a zero
    state, with the state reset before each position in ``resets``."""
    q, k, v, g, beta = _delta_inputs(query, key, value, g, beta, use_qk_l2norm_in_kernel)
    batch, heads, length, d_k = k.shape
    d_v = v.shape[-1]
    segments = _segments(length, resets)
    stop = segments[0][1]  # the tokens that read the incoming state: [0, stop)
    augmented = torch.cat([v[:, :, :stop], v.new_zeros(batch, heads, stop, d_k)], dim=-1)
    identity = torch.eye(d_k, dtype=v.dtype, device=v.device).expand(batch, heads, d_k, d_k)
    state = torch.cat([v.new_zeros(batch, heads, d_k, d_v), identity], dim=-1)
    out, state = _delta_chunks(q[:, :, :stop], k[:, :, :stop], augmented, g[:, :, :stop],
                               beta[:, :, :stop], chunk_size, state)
    outs, readouts = [out[..., :d_v]], [out[..., d_v:]]
    offset, transition = state[..., :d_v], state[..., d_v:]
    for start, stop in segments[1:]:
        out, offset = _delta_chunks(q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop],
                                    g[:, :, start:stop], beta[:, :, start:stop], chunk_size,
                                    v.new_zeros(batch, heads, d_k, d_v))
        outs.append(out)
        readouts.append(v.new_zeros(batch, heads, stop - start, d_k))
    if len(segments) > 1:
        transition = torch.zeros_like(transition)
    return PieceScan(torch.cat(outs, dim=2).transpose(1, 2),
                     torch.cat(readouts, dim=2).transpose(1, 2), transition, offset)


def _read_delta(readout: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return torch.einsum("blhk,bhkv->blhv", readout, state)


# ---- Mamba2 (SSD) ----------------------------------------------------------------------

def discretized_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor] = None,
                   dt_softplus: bool = False,
                   dt_limit: Tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """Mamba2's time step as its scan uses it (bias, softplus, clamp)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: sum of x over (j, i] below the diagonal, -inf above."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~keep, float("-inf"))


def _ssd_chunks(x, dt, A, B, C, chunk_size: int):
    """transformers' ``mamba2_chunk_scan`` without D, from a zero state, in
    the inputs' dtype: x [b, l, h, p], dt [b, l, h] (discretized), A [h],
    B, C [b, l, h, n]. (y [b, l, h, p], final state [b, h, p, n])."""
    batch, length, heads, _ = x.shape
    if length == 0:
        return x, x.new_zeros(batch, heads, x.shape[-1], B.shape[-1])
    pad = (-length) % chunk_size

    def chunked(t):
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, -1, chunk_size, *t.shape[2:])

    x, a, B, C = (chunked(t) for t in (x * dt[..., None], A * dt, B, C))
    a = a.permute(0, 3, 1, 2)  # b h c l
    a_cum = torch.cumsum(a, dim=-1)
    within = torch.exp(_segment_sum(a)).permute(0, 2, 3, 4, 1)
    scores = torch.einsum("bclhn,bcshn->bclsh", C, B) * within
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    across = torch.exp(_segment_sum(F.pad(a_cum[..., -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", across, states)
    states, final = states[:, :-1], states[:, -1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", C, states) * \
        torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).reshape(batch, -1, heads, x.shape[-1])[:, :length]
    return y, final


def mamba2_piece(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                 B: torch.Tensor, C: torch.Tensor, *, chunk_size: int = 256,
                 resets: Sequence[int] = ()) -> PieceScan:
    """Mamba2's SSD scan over a stretch (x [b, l, h, p], ``dt`` [b, l, h]
    already discretized (``discretized_dt``), A [h], B, C [b, l, groups, n])
    from a zero state, with the state reset before each position in
    ``resets``; without the D skip."""
    dtype = accumulator_dtype(hidden_states, dt, B, C)
    heads = hidden_states.shape[2]
    x, dt, A = hidden_states.to(dtype), dt.to(dtype), A.to(dtype)
    B, C = (t.to(dtype).repeat_interleave(heads // t.shape[2], dim=2) for t in (B, C))
    segments = _segments(x.shape[1], resets)
    outs, offset = [], None
    for start, stop in segments:
        out, offset = _ssd_chunks(x[:, start:stop], dt[:, start:stop], A, B[:, start:stop],
                                  C[:, start:stop], chunk_size)
        outs.append(out)
    stop = segments[0][1]  # the tokens that read the incoming state: [0, stop)
    decay = torch.cumsum(A * dt[:, :stop], dim=1)  # [b, l, h]
    readouts = [torch.exp(decay)[..., None] * C[:, :stop]] + \
        [C.new_zeros(C[:, a:b].shape) for a, b in segments[1:]]
    transition = torch.exp(A * dt[:, :stop].sum(dim=1))
    if len(segments) > 1:
        transition = torch.zeros_like(transition)
    return PieceScan(torch.cat(outs, dim=1), torch.cat(readouts, dim=1), transition, offset)


def _read_ssd(readout: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    return torch.einsum("blhn,bhpn->blhp", readout, state)


# ---- sharded -----------------------------------------------------------------------------

def _applied(transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """transition ∘ state (stacked alike): a matrix product, or a decay per
    (batch, head)."""
    if transition.dim() == state.dim():
        return transition @ state
    return transition[..., None, None] * state


class SummedOverRanks(torch.autograd.Function):
    """Every rank's tensor summed, on every rank; the gradient likewise
    (collective: every rank must run the backward)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.allreduce(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.allreduce(grad.contiguous()), None


def _composed(made: List[PieceScan], found: List[Run], read: Callable,
              initial: Optional[torch.Tensor], want_final: bool, comm, layout: str,
              cu_seqlens: Any):
    """The pieces' outputs with their incoming states read in, concatenated
    along the sequence, and the sequence's final state on every rank (or
    None). ``initial`` enters the piece that begins the sequence, to which
    the core gives a zero state; it reaches the later pieces through that
    piece's offset."""
    transitions = torch.stack([p.transition for p in made])
    offsets = torch.stack([p.offset for p in made])
    begins = torch.tensor([run.begins for run in found], dtype=offsets.dtype,
                          device=offsets.device).reshape(-1, *[1] * (offsets.dim() - 1))
    if initial is not None:
        entering = begins * initial.to(offsets.dtype)
        incoming = incoming_state(transitions, _applied(transitions, entering) + offsets, comm,
                                  layout=layout, cu_seqlens=cu_seqlens) + entering
    else:
        incoming = incoming_state(transitions, offsets, comm, layout=layout, cu_seqlens=cu_seqlens)
    out = torch.cat([p.out + read(p.readout, s) for p, s in zip(made, incoming)], dim=1)
    if not want_final:
        return out, None
    # summed from every piece (weight 0 but the last), so that on every rank the
    # final state's collective backward runs before incoming_state's
    ends = torch.tensor([run.ends for run in found], dtype=offsets.dtype,
                        device=offsets.device).reshape(begins.shape)
    final = (ends * (_applied(transitions, incoming) + offsets)).sum(0)
    return out, SummedOverRanks.apply(final, comm)


def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, comm, *, layout: str,
                     chunk_size: int = 64, cu_seqlens: Any = None,
                     initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' ``torch_chunk_gated_delta_rule`` on a sequence sharded
    in ``layout`` (this rank's shard: q, k [B, L, H_k, d_k], v [B, L, H_v, d_v],
    g, beta [B, L, H_v]). ``cu_seqlens``: documents restart from a zero
    state; ``initial_state`` [B, H_v, d_k, d_v] enters the sequence's first
    token. Returns (out in the query's dtype, the sequence's final state on
    every rank if ``output_final_state``, else None)."""
    found = runs(comm, "gated_delta_rule", sequence_length(key), layout, cu_seqlens,
                 lambda: delta_rule_facts(query, key, value, g, beta, initial_state, chunk_size,
                                          output_final_state, use_qk_l2norm_in_kernel),
                 initial_state is not None)
    made = [delta_rule_piece(query[:, r.start:r.stop], key[:, r.start:r.stop],
                             value[:, r.start:r.stop], g[:, r.start:r.stop],
                             beta[:, r.start:r.stop], chunk_size=chunk_size, resets=r.resets,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            for r in found]
    out, final = _composed(made, found, _read_delta, initial_state, output_final_state, comm,
                           layout, cu_seqlens)
    return out.to(query.dtype), final


def mamba2_scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                B: torch.Tensor, C: torch.Tensor, comm, *, layout: str, chunk_size: int = 256,
                D: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                initial_states: Optional[torch.Tensor] = None, dt_softplus: bool = False,
                dt_limit: Tuple[float, float] = (0.0, float("inf")),
                return_final_states: bool = False, cu_seqlens: Any = None) -> Any:
    """transformers' ``mamba2_chunk_scan`` (Mamba2's chunked SSD scan) on a
    sequence sharded in ``layout`` (this rank's shard: x [b, l, h, p], dt
    [b, l, h] before bias/softplus/clamp, A [h], B, C [b, l, groups, n],
    D [h]). ``cu_seqlens``: documents restart from a zero state;
    ``initial_states`` [b, h, p, n] enters the sequence's first token.
    Returns y in x's dtype, and with ``return_final_states`` (y, the
    sequence's final state on every rank)."""
    found = runs(comm, "mamba2_scan", sequence_length(hidden_states), layout, cu_seqlens,
                 lambda: mamba2_facts(hidden_states, dt, A, B, C, D, dt_bias, initial_states,
                                      chunk_size, dt_softplus, tuple(dt_limit),
                                      return_final_states),
                 initial_states is not None)
    dt = discretized_dt(dt, dt_bias, dt_softplus, dt_limit)
    made = [mamba2_piece(hidden_states[:, r.start:r.stop], dt[:, r.start:r.stop], A,
                         B[:, r.start:r.stop], C[:, r.start:r.stop], chunk_size=chunk_size,
                         resets=r.resets)
            for r in found]
    y, final = _composed(made, found, _read_ssd, initial_states, return_final_states, comm,
                         layout, cu_seqlens)
    if D is not None:
        y = y + D.to(y.dtype)[:, None] * hidden_states.to(y.dtype)
    y = y.to(hidden_states.dtype)
    return (y, final) if return_final_states else y
