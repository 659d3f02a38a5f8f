"""A hybrid model's plan: its attention layers and its recurrent mixers
priced together, over the sequence layouts both can read.

The recurrent layers (``commlib.recurrent``) pass states: per layer each
rank receives every other rank's pieces' (transition, offset), a
few MiB whatever the sequence length, in one all-gather, and scans its own
L/P tokens. Their cost does not depend on the Ulysses degree (they shard the
sequence over every rank), but it does depend on the layout: a zigzag rank
holds two pieces, so it gathers twice the states of a contiguous one, while
a contiguous ring leaves causal attention uneven (its last rank does R -
1/2 of R blocks). With a large state and few attention layers (Qwen3-Next:
three recurrent layers to one attention layer, 2 MiB of state a layer) the
balance can tip, so the layout is priced over the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ..sequence.documents import chunks_of
from ..topology import Topology
from .planner import Fabric, SplitPlan, Spread, exchange_seconds, plan, probe

__all__ = ["RecurrentLayers", "RecurrentCost", "ModelPlan", "price_recurrent", "plan_model"]

_HALO = 3  # the kernel-4 causal convolution's tokens before each piece


@dataclass(frozen=True)
class RecurrentLayers:
    """A model's recurrent mixers, as priced: ``count`` layers, each
    ``heads`` states of ``rows`` x ``cols`` (Gated DeltaNet: d_k x d_v, with a
    d_k x d_k transition, ``matrix``; Mamba2: headdim x dstate, one decay a
    head), ``channels`` convolved by the kernel-4 convolution, ``chunk``
    tokens a chunk of the local scan, states in float32."""

    count: int
    heads: int
    rows: int
    cols: int
    matrix: bool
    channels: int = 0
    chunk: int = 64

    def piece_bytes(self, gradient: bool = False) -> int:
        """A piece's (transition, offset), and its state's gradient with it."""
        transition = self.heads * (self.rows * self.rows if self.matrix else 1) * 4
        state = self.heads * self.rows * self.cols * 4
        return transition + state * (2 if gradient else 1)

    def flops_per_token(self) -> float:
        """The local chunked scan: the state's update and readout (the gated
        delta rule carries ``rows`` extra value columns for its transition)
        and the attention-like product inside a chunk."""
        cols = self.cols + (self.rows if self.matrix else 0)
        return self.heads * (4 * self.rows * cols + 2 * self.chunk * (2 * self.rows + cols))


@dataclass(frozen=True)
class RecurrentCost:
    """One recurrent layer per rank: bytes received (the states' all-gather
    and the halo), their seconds, and the local scan's."""

    bytes: float
    comm_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return self.comm_s + self.compute_s


def price_recurrent(size: int, seq_len: int, layers: RecurrentLayers, fabric: Fabric, *,
                    layout: str, itemsize: int = 2, topology: Optional[Topology] = None,
                    backward: bool = False) -> RecurrentCost:
    """One of ``layers`` over ``size`` ranks in ``layout`` (contiguous or
    zigzag): per forward, or forward and backward where ``backward`` (the
    pairs again with the states' gradients, the halo's gradients back, the
    scan's work three times)."""
    if layout not in ("contiguous", "zigzag"):
        raise ValueError(f"the model plan prices the contiguous and zigzag layouts, not "
                         f"{layout!r}")
    if size == 1:
        return RecurrentCost(0.0, 0.0, seq_len * layers.flops_per_token()
                             * (3 if backward else 1) / fabric.flops)
    pieces = len(chunks_of(0, size, layout))
    remote = Spread.of(topology or Topology(0, (0,) * size), size).ulysses_remote
    halo = pieces * _HALO * layers.channels * itemsize
    per_peer = pieces * layers.piece_bytes() + halo
    # the states' and the halo's exchanges, each after its agreement
    calls = 4 if layers.channels else 2
    received = per_peer * (size - 1)
    seconds = exchange_seconds(fabric, size, remote, per_peer, calls)
    if backward:
        back = pieces * layers.piece_bytes(gradient=True) + halo
        received += back * (size - 1)
        seconds += exchange_seconds(fabric, size, remote, back, calls)
    scan = 2 * size * pieces * layers.heads * layers.rows * \
        (layers.rows if layers.matrix else 1) * layers.cols
    work = (seq_len / size) * layers.flops_per_token() + scan
    return RecurrentCost(received, seconds, work * (3 if backward else 1) / fabric.flops)


@dataclass(frozen=True)
class ModelPlan:
    """The pick for a whole model: ``layout`` and its attention ``plan``
    (Ulysses x Ring, ring method), ``attention_layers`` of it and the
    recurrent layers at ``recurrent`` each; ``priced``: (layout, seconds)
    of every layout, per step (forward, and backward where planned so)."""

    layout: str
    plan: SplitPlan
    attention_layers: int
    recurrent_layers: int
    recurrent: Optional[RecurrentCost]
    predicted_seconds: float
    priced: List[Tuple[str, float]]

    def explain(self) -> str:
        layouts = "; ".join(f"{layout} {seconds * 1e3:.1f} ms" for layout, seconds in self.priced)
        attention = self.plan.explain().split(". ", 1)[0]
        recurrent = "" if self.recurrent is None else (
            f" Each of {self.recurrent_layers} recurrent layers: receives "
            f"{self.recurrent.bytes / 2**20:.2f} MiB a rank, {self.recurrent.comm_s * 1e3:.2f} "
            f"ms exchanging, {self.recurrent.compute_s * 1e3:.2f} ms scanning.")
        return (f"Picked {self.layout} ({self.predicted_seconds * 1e3:.1f} ms predicted for "
                f"the model; {layouts}). Attention, each of {self.attention_layers} layers: "
                f"{attention}.{recurrent}")


def plan_model(comm: Any, seq_len: int, *, attention_layers: int, num_heads: int,
               num_kv_heads: int, head_dim: int, recurrent: Optional[RecurrentLayers] = None,
               itemsize: int = 2, layouts: Sequence[str] = ("zigzag", "contiguous"),
               backward: bool = False, fabric: Optional[Fabric] = None,
               latent_width: Optional[int] = None) -> ModelPlan:
    """The cheapest layout for a causal model of ``attention_layers``
    attention layers (priced by ``commlib.hybrid.plan``, which picks their
    Ulysses x Ring split; ``latent_width``: r + d_rope of multi-head latent
    attention, whose pure ring moves the latent) and ``recurrent`` mixers,
    over the probed (or given) fabric of ``comm``."""
    fabric = fabric or probe(comm)
    padded = -(-seq_len // comm.size) * comm.size
    options = []
    for layout in layouts:
        picked = plan(comm, seq_len, num_heads, num_kv_heads, head_dim, itemsize, causal=True,
                      layout=layout, backward=backward, fabric=fabric,
                      latent_width=latent_width)
        cost = None if recurrent is None else price_recurrent(
            comm.size, padded, recurrent, fabric, layout=layout, itemsize=itemsize,
            topology=comm.topology, backward=backward)
        total = attention_layers * picked.predicted_seconds + \
            (0.0 if cost is None else recurrent.count * cost.seconds)
        options.append((total, layout, picked, cost))
    total, layout, picked, cost = min(options, key=lambda option: option[0])
    return ModelPlan(layout, picked, attention_layers, 0 if recurrent is None else recurrent.count,
                     cost, total, [(option[1], option[0]) for option in options])
