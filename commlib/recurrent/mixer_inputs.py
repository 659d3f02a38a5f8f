"""The sharded mixers' inputs checked, the same for every framework: each
check raises ValueError on bad shapes or returns the facts every rank must
share (``commlib.recurrent.mixer_pieces`` agrees them), so that the torch and JAX
mixers refuse the same input with the same message, on every rank."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..namespace import dtype_name

__all__ = ["delta_rule_facts", "mamba2_facts", "sequence_length"]


def sequence_length(x: Any) -> int:
    """The shard's length of a [batch, length, heads, dim] input (0 when it
    is not 4-D: its check then says so)."""
    return int(x.shape[1]) if x.ndim == 4 else 0


def _shape_problem(name: str, x: Optional[Any], shape: Tuple[int, ...]) -> None:
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def _chunk_problem(chunk_size: Any) -> None:
    if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) \
            or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def delta_rule_facts(query: Any, key: Any, value: Any, g: Any, beta: Any,
                     initial_state: Optional[Any], chunk_size: int, *flags: Any) -> tuple:
    """Gated delta rule: q, k [B, L, H_k, d_k], v [B, L, H_v, d_v], g, beta
    [B, L, H_v], initial_state [B, H_v, d_k, d_v], H_v a multiple of H_k."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError("query, key and value must be [batch, length, heads, head_dim]")
    _chunk_problem(chunk_size)
    batch, length, k_heads, d_k = key.shape
    v_heads, d_v = value.shape[2:]
    _shape_problem("query", query, key.shape)
    _shape_problem("value", value, (batch, length, v_heads, d_v))
    _shape_problem("g", g, (batch, length, v_heads))
    _shape_problem("beta", beta, (batch, length, v_heads))
    _shape_problem("initial_state", initial_state, (batch, v_heads, d_k, d_v))
    if v_heads % k_heads:
        raise ValueError(f"{v_heads} value heads cannot share {k_heads} key heads")
    return (tuple(query.shape), tuple(value.shape), dtype_name(query), int(chunk_size),
            initial_state is not None) + flags


def mamba2_facts(hidden_states: Any, dt: Any, A: Any, B: Any, C: Any, D: Optional[Any],
                 dt_bias: Optional[Any], initial_states: Optional[Any], chunk_size: int,
                 *flags: Any) -> tuple:
    """Mamba2: x [b, l, h, p], dt [b, l, h], A, D, dt_bias [h], B, C
    [b, l, groups, n], initial_states [b, h, p, n], h a multiple of groups."""
    if hidden_states.ndim != 4 or B.ndim != 4:
        raise ValueError("hidden_states and B must be [batch, length, heads or groups, dim]")
    _chunk_problem(chunk_size)
    batch, length, heads, head_dim = hidden_states.shape
    _shape_problem("dt", dt, (batch, length, heads))
    _shape_problem("A", A, (heads,))
    _shape_problem("C", C, B.shape)
    _shape_problem("D", D, (heads,))
    _shape_problem("dt_bias", dt_bias, (heads,))
    _shape_problem("initial_states", initial_states, (batch, heads, head_dim, B.shape[3]))
    if tuple(B.shape[:2]) != (batch, length) or heads % B.shape[2]:
        raise ValueError(f"B {tuple(B.shape)} does not match hidden_states "
                         f"{tuple(hidden_states.shape)} (heads a multiple of groups)")
    return (tuple(hidden_states.shape), tuple(B.shape), dtype_name(hidden_states), int(chunk_size),
            D is not None, dt_bias is not None, initial_states is not None) + flags
