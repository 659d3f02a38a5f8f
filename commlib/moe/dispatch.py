"""MoE dispatch and combine: the variable-size all-to-all of expert
parallelism, deduplicated per destination rank, flat or two-hop.

Dispatch, per hop: a token goes to a destination rank once, however many of
its experts live there (DeepEP's layout: count tokens once per destination,
not once per token-expert pair), with a little metadata saying which of its
experts (and weights) that rank serves. The owner expands each arrival into
one row per local expert: ``expert_x``, grouped by local expert.

Combine mirrors it: each owner sums a token's weighted expert outputs
locally, so a token's result travels back once per rank it visited, and the
sender adds up what comes back.

Flat: one hop, straight to the owners. Two-hop (``hierarchical``): a token
first crosses to each destination node once, to the rank there with the
sender's local rank, which forwards it inside the node to the owners; on the
way back the forwarder sums inside the node before the one crossing back.

Capacity: each expert takes at most ``ceil(T * k / E * capacity_factor)``
assignments from each source rank; the rest are dropped (by lowest weight or
latest position), contribute nothing, and are counted.

Fixed capacity (``max_tokens_per_rank`` C, DeepEP's low-latency layout):
every hop's block to a rank has a fixed number of rows, known from C, the
capacity factor and the topology alone; empty slots carry the id -1, so the
counts travel inside the payload and a dispatch or combine is one exchange
per hop with known sizes, no count exchange and no read of the device.
``expert_x`` is [local experts, P * per-source cap, H], each expert's rows
first, padding after (``tokens_per_expert`` on the device says how many).
What does not fit (more than C tokens, or more than C assignments of an
expert from one rank, which only a token naming an expert more than once
makes) is dropped and counted; the counts stay on the device until
``collect_stats()``. A token naming an expert twice is two assignments in
every mode and layout: two rows of ``expert_x``, counted twice, each
weighed by its own weight in combine.

FP8 (``quantize="fp8"``): the sender quantizes each row to e4m3 with a
float32 scale per 128 channels (``commlib.moe.quantize``); the owner gets
(values, scales), or x's dtype back with ``dequantize=True``. Combine
travels in expert_y's dtype.

Overlap: ``dispatch_async`` / ``combine_async`` return once the first hop
is in flight; ``wait()`` finishes it. Over MPI the progress thread moves
the bytes meanwhile (``commlib.progress``). Two hops are pipelined
(``commlib.moe.pipeline``): the inter-node hop goes in chunks, each
forwarded inside its node and expanded by its owners (``commlib.moe.expand``)
while the next one crosses, and combine sends each chunk back while the
owners sum the next; the sums are one exchange's, bit for bit.

Everything runs in the caller's framework, on its device (torch ops for torch
tensors, ``jax.numpy`` for JAX arrays, NumPy for NumPy): permutations,
metadata, expansion and sums. Only the rows cross into the transport, in
their own dtype (bfloat16 stays bfloat16 on the wire), each with its
token's expert ids and weights (float32) in the same message; weights and
sums are float32.

Without a fixed capacity the host waits for the device once per dispatch
(``commlib.moe.counted``); combine and both backwards read nothing from the
device: they reuse the counts kept in the handle.

This module is the front: it checks the input, makes the wire, picks one
path per dispatch and hands it over. The paths, each with its dispatch,
combine, backwards, statistics, output shape and handle:

- ``commlib.moe.counted.CountedPath``: no fixed capacity; flat, or two-hop
  (pipelined).
- ``commlib.moe.fixed.FixedPath``: a fixed capacity in per-destination
  blocks; flat or two-hop.
- ``commlib.moe.lowlatency.LowLatencyPath``: a flat fixed capacity without
  a capacity factor in DeepEP's low-latency slots, while a peer's block is
  at most ``LOW_LATENCY_MOST_BYTES`` (the decode path).

A handle names the path that made it, and combine and the backwards go
there.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import numpy as np

from ..namespace import dtype_name, framework
from . import contract, lowlatency
from .counted import CountedPath
from .experts import Experts
from .fixed import FixedPath
from .lowlatency import LowLatencyHandle, LowLatencyPath
from .placement import Placement
from .routed import DispatchHandle
from .stats import DispatchStats
from .wire import PendingMoE, Wire, row_bytes

__all__ = ["Dispatcher"]

Path = Union[CountedPath, FixedPath, LowLatencyPath]
Handle = Union[DispatchHandle, LowLatencyHandle]


class Dispatcher:
    """Expert-parallel dispatch and combine over ``comm``: expert e of
    ``num_experts`` lives on rank ``e // (num_experts // comm.size)``.
    ``max_tokens_per_rank`` selects the fixed-capacity mode.

    ``placement`` (a ``commlib.moe.Placement`` of ``num_experts`` logical
    experts on ``comm.size`` ranks, the same on every rank): the experts laid
    out are its physical slots instead, slot p on rank
    ``p // slots_per_rank``. The router's ids stay logical; each is sent to
    the slot ``placement.replica_table[comm.rank]`` names for it and the
    token's row (each replica an equal share of the expert's tokens: those
    on this rank first, then on its node, then any), so ``expert_x`` is
    grouped by this rank's slots, slot j running logical expert
    ``placement.slots[rank][j]``. Capacities are per logical expert and
    applied before the replica is chosen: the same assignments are dropped
    as without a placement.

    ``pipeline_chunks``: the chunks a two-hop dispatch cuts its inter-node
    hop into, 1 for none; None, the default, chooses from the bytes
    (``commlib.moe.pipeline``). Flat dispatch has one hop, so it refuses a
    count above 1. The attribute may be changed between dispatches: each
    dispatch checks it and agrees on it with every rank."""

    def __init__(self, comm, num_experts: int, *, capacity_factor: Optional[float] = None,
                 drop_policy: str = "probs", hierarchical: bool = False,
                 max_tokens_per_rank: Optional[int] = None,
                 pipeline_chunks: Optional[int] = None,
                 placement: Optional[Placement] = None):
        contract.agree_options(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                               max_tokens_per_rank, pipeline_chunks, placement=placement)
        self.experts = Experts(comm, num_experts, capacity_factor, drop_policy, hierarchical,
                               max_tokens_per_rank, pipeline_chunks, placement)
        self.comm = comm
        self.num_experts = num_experts
        self.placement = placement
        self.num_slots = self.experts.num_slots
        self.local_experts = self.experts.local_experts  # slots on each rank
        self.capacity_factor = capacity_factor
        self.drop_policy = drop_policy
        self.hierarchical = hierarchical
        self.max_tokens_per_rank = max_tokens_per_rank
        self.stats = DispatchStats.zeros(num_experts, comm.size, self.num_slots)
        self._routed: Union[CountedPath, FixedPath] = CountedPath(self.experts) \
            if max_tokens_per_rank is None else FixedPath(self.experts)
        slots = LowLatencyPath(self.experts)
        self._slots: Optional[LowLatencyPath] = slots if slots.takes(None) else None
        self._paths: Tuple[Path, ...] = (self._routed,) + ((slots,) if self._slots else ())

    @property
    def pipeline_chunks(self) -> Optional[int]:
        return self.experts.pipeline_chunks

    @pipeline_chunks.setter
    def pipeline_chunks(self, chunks: Optional[int]) -> None:
        self.experts.pipeline_chunks = chunks  # checked and agreed on by the next dispatch

    # -- the paths --------------------------------------------------------------
    def path_for(self, x: Any, quantize: Optional[str] = None) -> Path:
        """The path a dispatch of ``x`` (its shape, dtype and framework:
        fake tensors do) with ``quantize`` takes; its ``name`` says which."""
        return self._choose(x, row_bytes(x, quantize))

    def describe(self) -> str:
        """The paths this Dispatcher's dispatches take, in words."""
        if self._slots is None:
            return self._routed.name
        return (f"{self._slots.name} while a peer's block is at most "
                f"{lowlatency.LOW_LATENCY_MOST_BYTES} bytes (not for JAX arrays), "
                f"else {self._routed.name}")

    def expert_shape(self, x: Any, k: int, quantize: Optional[str] = None
                     ) -> Optional[Tuple[int, ...]]:
        """``expert_x``'s shape for a dispatch of ``x`` with ``k`` experts a
        token (fake tensors do); None where its rows are known only when it
        runs (counted)."""
        return self.path_for(x, quantize).expert_shape(x, k)

    def _choose(self, x: Any, row_bytes: Optional[int]) -> Path:
        """The low-latency slots where they take these rows (not JAX arrays:
        they are immutable, and the slots write into kept buffers); else
        the routed path of the options."""
        if self._slots is not None and self._slots.takes(row_bytes) \
                and framework(x) != "jax":
            return self._slots
        return self._routed

    # -- dispatch ---------------------------------------------------------------
    def dispatch(self, x: Any, experts: Any, weights: Any, *, quantize: Optional[str] = None,
                 dequantize: bool = False) -> Tuple[Any, Handle]:
        """Send each token's row to the ranks of its experts. ``x`` [T, H];
        ``experts`` [T, k] int (-1: no expert); ``weights`` [T, k]; all three
        of one framework, on one device. Returns ``expert_x`` grouped by
        local expert, in x's framework, and the handle for ``combine``:
        [rows, H] in x's dtype, or under a fixed capacity [local experts,
        slots, H] whose first ``tokens_per_expert[e]`` rows of expert e are
        real (the rest is padding, never read back). ``quantize="fp8"``:
        the rows travel as e4m3 with a float32 scale per 128 channels, and
        ``expert_x`` is (values, scales), or x's dtype with ``dequantize``."""
        return self.dispatch_async(x, experts, weights, quantize=quantize,
                                   dequantize=dequantize).wait()

    def dispatch_async(self, x: Any, experts: Any, weights: Any, *,
                       quantize: Optional[str] = None, dequantize: bool = False) -> PendingMoE:
        """``dispatch``, returned as soon as its first hop is in flight:
        ``.wait()`` gives (expert_x, handle). Computation in between (another
        micro-batch's experts) overlaps the transfer; over MPI a progress
        thread moves it meanwhile. x must not change until the wait. The
        input is checked here, once; the path agrees on it with every rank
        (a rank's bad input takes the path the options give, so that every
        rank's agreement is the same call)."""
        problem = contract.input_problem(x, experts, weights, quantize) \
            or contract.chunks_problem(self.pipeline_chunks, self.hierarchical)
        wire = Wire.of(x, quantize, dequantize) if problem is None else None
        path = self._choose(x, None if wire is None else int(wire.payload.shape[1]))
        facts = () if problem is not None else self._facts(x, experts, quantize, dequantize)
        pending, stats = path.dispatch(x, experts, weights, wire, facts, problem)
        if stats is not None:
            self.stats = self.stats + stats
        return pending

    def _facts(self, x: Any, experts: Any, quantize: Optional[str],
               dequantize: bool) -> Tuple[str, ...]:
        """What every rank's dispatch must share."""
        return (f"k={experts.shape[-1] if experts.ndim == 2 else None}",
                f"row shape {tuple(x.shape[1:])}", f"dtype {dtype_name(x)}",
                f"quantize={quantize}", f"dequantize={bool(dequantize)}",
                f"pipeline_chunks={self.pipeline_chunks}")

    def collect_stats(self) -> DispatchStats:
        """Fixed capacity: the global stats of every dispatch since the last
        collection (one copy from each device, one allreduce), also added
        to ``stats``. Collective: every rank calls it. Expert ids outside
        [-1, E), which this mode cannot refuse without reading the device,
        are counted in ``invalid``."""
        count, size = self.num_slots, self.comm.size
        kept, dropped = np.zeros(count, np.int64), np.zeros(count, np.int64)
        traffic, invalid = np.zeros((size, size), np.int64), 0
        for path in self._paths:
            held = path.unreported()
            if held is not None:
                kept, dropped, traffic = kept + held[0], dropped + held[1], traffic + held[2]
                invalid += held[3]
        stats = DispatchStats.gather(self.comm, kept, dropped, traffic, invalid=invalid,
                                     slot_experts=self.experts.slot_experts)
        self.stats = self.stats + stats
        return stats

    # -- combine: the path that dispatched ---------------------------------------
    def combine(self, expert_y: Any, handle: Handle) -> Any:
        """y[t] = sum_j weights[t, j] * expert_y of (t, experts[t, j]),
        summed where the experts are and sent back once per rank visited;
        zero for a token with no (kept) expert. In expert_y's framework and
        dtype; the sums are float32, the rows travel in expert_y's dtype."""
        return self.combine_async(expert_y, handle).wait()

    def combine_async(self, expert_y: Any, handle: Handle) -> PendingMoE:
        """``combine``, returned as soon as the way back is in flight;
        ``.wait()`` gives y."""
        return handle.path.combine(expert_y, handle)

    # -- gradients (commlib.bindings): the same paths, mirrored ------------------
    def dispatch_backward(self, d_expert_x: Any, handle: Handle) -> Any:
        """d x from d expert_x (the dispatch's framework): each expert row's
        gradient summed back to its token along the combine path."""
        return handle.path.dispatch_backward(d_expert_x, handle)

    def combine_backward(self, expert_y: Any, d_y: Any, handle: Handle,
                         k: int) -> Tuple[Any, Any]:
        """(d expert_y, d weights [T, k] float32) from d y (the dispatch's
        framework): d y travels the dispatch path to the expert rows, where
        d expert_y = w * d y and each slot's d w = <d y, expert_y> travels
        back to its token."""
        return handle.path.combine_backward(expert_y, d_y, handle, k)
