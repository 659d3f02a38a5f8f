"""One dispatch call: what this rank works out before anything moves
(``Plan``), the host counts of a counted dispatch (``Counts``), how the rows
travel (``Wire``), what combine needs to undo it (``DispatchHandle``), and a
dispatch or combine in flight (``PendingMoE``). Shared by the counted path
(``commlib.moe.dispatch``) and the fixed-capacity one (``commlib.moe.fixed``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from .expand import GatheredRows, ScatteredRows
from .hops import Hop
from .pipeline import TwoHopRoute
from .stats import DispatchStats

__all__ = ["DispatchHandle", "PendingMoE", "Plan", "Counts", "Wire"]


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
    framework, on its device."""

    tokens_per_expert: Any
    stats: Optional[DispatchStats]
    route: Union[Hop, TwoHopRoute] = field(repr=False)
    owned: List[Union[ScatteredRows, GatheredRows]] = field(repr=False)
    arrival_rows: Any = field(repr=False)     # received row of each expert row (padding: R)
    arrival_slots: Any = field(repr=False)    # which of the token's k slots it is
    arrival_weights: Any = field(repr=False)  # its routing weight (float32; padding: 0)
    received_rows: int = field(repr=False)
    expert_shape: Tuple[int, ...] = field(default=(), repr=False)  # fixed: (local experts, slots)


class PendingMoE:
    """A dispatch or combine in flight: ``wait()`` gives its result, once.
    Dropped without a wait, its transfer fails the communicator, so the
    next call raises on every rank instead of hanging."""

    def __init__(self, finish: Callable[[], Any]):
        self._finish: Optional[Callable[[], Any]] = finish

    def wait(self) -> Any:
        if self._finish is None:
            raise RuntimeError("this dispatch or combine was already waited on")
        finish, self._finish = self._finish, None
        return finish()


@dataclass
class Plan:
    """This rank's side of a dispatch, worked out on its device before
    anything moves; the host parts come from the dispatch's one copy (none
    under a fixed capacity)."""

    ids: Any                  # [T, k] expert ids after capacity (-1: none)
    gate: Any                 # [T, k] float32 weights
    keys: Any                 # hop 1: sorted destination * T + row, one per slot
    first: Any                # keys that start a (destination, row) copy
    dropped: Any              # [E] on the device: assignments over capacity (None: no cap)
    invalid: Any              # [1] on the device: ids outside [-1, E)
    extremes: Any             # [2] on the device: the smallest and largest id given


@dataclass
class Counts:
    """The host counts of a dispatch without a fixed capacity, per chunk of
    a pipelined two-hop dispatch (one chunk otherwise)."""

    send: np.ndarray               # [chunks, P] rows to each rank on hop 1
    forward: Optional[np.ndarray]  # two hops: [chunks, P] rows each owner will get
    assigned: Optional[np.ndarray]  # two hops: [chunks, P] assignments to each owner
    requested: np.ndarray         # assignments per expert after capacity
    dropped: np.ndarray           # assignments per expert over capacity
    id_range: Tuple[int, int]
    receive: Optional[np.ndarray] = None  # flat: [P] rows from each rank, from the agreement


@dataclass
class Wire:
    """How x's rows travel: their bytes [T, n]; how the owner reads the
    received bytes back (x's rows, FP8 values and scales, or those already
    dequantized: once per received row, before the rows are expanded into
    one per expert); and how the expanded parts make ``expert_x``."""

    payload: Any
    decode: Callable[[Any], Tuple[Any, ...]]
    deliver: Callable[[Tuple[Any, ...]], Any]
