"""What the routed dispatch paths share (counted, ``commlib.moe.counted``,
and per-destination fixed, ``commlib.moe.fixed``; flat or two-hop): a
token's row travels once per rank it visits along a route (one ``Hop``, or
a ``TwoHopRoute``), and the owner expands it into one row per local
expert. Combine and the backwards follow the same route: each owner sums a
token's weighted expert rows per arrival, the sums go back once per rank
visited, and the sender adds them up. Their handle is ``DispatchHandle``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple, Union

from ..namespace import dtype_name, float32, namespace, sum_rows
from . import contract
from .expand import GatheredRows, ScatteredRows
from .experts import Experts
from .hops import Hop, take_sent
from .pipeline import TwoHopRoute
from .stats import DispatchStats
from .wire import PendingMoE

__all__ = ["DispatchHandle", "RoutedPath"]


@dataclass
class DispatchHandle:
    """What combine needs to undo a dispatch, and what the dispatch saw.

    ``tokens_per_expert[e]``: rows of ``expert_x`` for this rank's local
    expert e: host int64, or, under a fixed capacity, an array in x's
    framework on its device (the dispatch reads nothing back). ``stats``:
    the global picture of this dispatch (None under a fixed capacity:
    ``Dispatcher.collect_stats()`` gathers those). ``route``: the way the
    rows came, flat (one ``Hop``) or two-hop (a ``TwoHopRoute``), with
    ``send`` and ``back`` along it; ``owned``: how combine sums the expert
    rows per arrival, one record per chunk of the route, or one for every
    chunk (``commlib.moe.expand``). The index arrays are in the caller's
    framework, on its device. ``path``: the path that made it, which
    combine and the backwards take."""

    tokens_per_expert: Any
    stats: Optional[DispatchStats]
    route: Union[Hop, TwoHopRoute] = field(repr=False)
    owned: List[Union[ScatteredRows, GatheredRows]] = field(repr=False)
    arrival_rows: Any = field(repr=False)     # received row of each expert row (padding: R)
    arrival_slots: Any = field(repr=False)    # which of the token's k slots it is
    arrival_weights: Any = field(repr=False)  # its routing weight (float32; padding: 0)
    received_rows: int = field(repr=False)
    expert_shape: Tuple[int, ...] = field(default=(), repr=False)  # fixed: (local experts, slots)
    path: Any = field(default=None, repr=False)


class RoutedPath:
    """Combine, the backwards and the two directions of a routed dispatch
    path (its subclasses dispatch)."""

    name = "routed"

    def __init__(self, experts: Experts):
        self.experts = experts
        self.comm = experts.comm

    def combine(self, expert_y: Any, handle: DispatchHandle) -> PendingMoE:
        """combine's checks and agreement, then the way back, weighed."""
        problem = contract.combine_problem(
            expert_y, handle.expert_shape or (int(handle.arrival_rows.shape[0]),),
            handle.arrival_rows)
        facts = (f"dtype {dtype_name(expert_y)}",
                 f"row shape {tuple(expert_y.shape[len(handle.expert_shape) or 1:])}") \
            if problem is None else ()
        self.comm.agree("moe.combine", *facts, problem=problem)
        return self._to_tokens(expert_y, handle, weighted=True)

    def dispatch_backward(self, d_expert_x: Any, handle: DispatchHandle) -> Any:
        """d x: each expert row's gradient summed back to its token along
        the combine path."""
        return self._to_tokens(d_expert_x, handle).wait()

    def combine_backward(self, expert_y: Any, d_y: Any, handle: DispatchHandle,
                         k: int) -> Tuple[Any, Any]:
        """(d expert_y, d weights): d y travels the dispatch path to the
        expert rows, where d expert_y = w * d y and each slot's d w =
        <d y, expert_y> travels back to its token."""
        xp = namespace(expert_y)
        rows = _expert_rows(expert_y, handle)
        arrived = float32(take_sent(self.send_rows(d_y, handle), handle.arrival_rows,
                                     handle.received_rows))
        weights = xp.reshape(handle.arrival_weights, (-1,) + (1,) * (arrived.ndim - 1))
        d_expert_y = xp.reshape(xp.astype(arrived * weights, expert_y.dtype), expert_y.shape)
        dots = xp.sum(arrived * float32(rows), axis=tuple(range(1, arrived.ndim)))
        slots = handle.arrival_rows * k + handle.arrival_slots  # padding: the spare R * k
        per_slot = sum_rows(dots, slots, handle.received_rows * k + 1)
        per_slot = xp.reshape(per_slot[:handle.received_rows * k], (handle.received_rows, k))
        return d_expert_y, self.return_rows(per_slot, handle)

    def return_rows(self, rows: Any, handle: DispatchHandle, dtype: Any = None) -> Any:
        """Per-arrival rows [received, ...] back along the dispatch path to
        the tokens [T, ...], summing the copies of a token in float32 (the
        adjoint of ``send_rows``). Travels as ``dtype`` (default: as is)."""
        return handle.route.back(self.comm, handle.route.split(rows),
                                 rows.dtype if dtype is None else dtype)()

    def send_rows(self, tokens: Any, handle: DispatchHandle) -> Any:
        """Per-token rows [T, ...] along the dispatch path to the arrivals
        [received, ...], one copy per rank a token visits (the adjoint of
        ``return_rows``)."""
        return handle.route.send(self.comm, tokens)

    def _to_tokens(self, expert_rows: Any, handle: DispatchHandle,
                   weighted: bool = False) -> PendingMoE:
        """Expert rows (optionally weighted) summed in float32 per arrival,
        then back to their tokens: combine's path, and dispatch's adjoint.
        Each chunk of the route is summed when it can leave
        (``handle.owned``), so a pipelined route sends the first back while
        the rest are summed."""
        rows = _expert_rows(expert_rows, handle)
        if len(handle.owned) < handle.route.chunks:  # one record for every chunk
            return PendingMoE(handle.route.back(
                self.comm, handle.route.split(handle.owned[0].sums(rows, weighted)), rows.dtype))

        def sums(chunk: int) -> Any:
            return handle.owned[chunk].sums(rows, weighted)
        return PendingMoE(handle.route.back(self.comm, sums, rows.dtype))


def _expert_rows(expert_rows: Any, handle: DispatchHandle) -> Any:
    """Expert rows as [rows, ...] (a fixed capacity's [L, slots, ...]
    flattened)."""
    if not handle.expert_shape:
        return expert_rows
    xp = namespace(expert_rows)
    return xp.reshape(expert_rows, (-1,) + tuple(expert_rows.shape[2:]))
