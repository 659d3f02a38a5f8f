"""Expert placement with redundant experts, and the rebalancer that chooses it.

A ``Placement`` maps physical expert slots to logical experts: every rank has
the same number of slots, slot ``p`` lives on rank ``p // slots_per_rank``, and
a busy logical expert may fill several slots (replicas) so that its tokens are
shared. ``rebalance`` chooses one from measured loads (DeepSeek-V3's redundant
experts, arXiv:2412.19437 section 3.4, and the ``eplb.py`` of deepseek-ai/EPLB):
as balanced as DeepSeek's algorithm or better, and, given the current
placement, moving as few expert weights as a balance within a tolerance allows.

Balance is measured as DeepSeek's is: a logical expert's load splits evenly over
its replicas, and a rank carries the sum of its slots' shares.
"""

from __future__ import annotations

import functools
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

EMPTY = -1  # a slot that holds no expert (a drained rank has only these)
# replica_table's columns at most: replica counts whose lcm is larger share
# a sender's tokens over its replicas within 1 / MAX_COLUMNS of exactly
MAX_COLUMNS = 120


@dataclass(frozen=True, eq=False)
class Placement:
    """Logical experts on the physical slots of ``ranks`` ranks in ``nodes``
    nodes (ranks per node consecutive, as ``commlib.Topology`` numbers them).

    ``physical_to_logical[p]`` is the logical expert in slot ``p``, or
    ``EMPTY`` (-1). Every rank has ``slots_per_rank`` slots, so expert weights
    fit one fixed-shape buffer per rank; a rank whose slots are all empty is
    drained (it receives no tokens). Every logical expert has at least one
    replica. Immutable and hashable, so it can be a static argument under
    ``jax.jit``.
    """

    num_logical: int
    ranks: int
    nodes: int
    physical_to_logical: np.ndarray

    def __post_init__(self) -> None:
        for name in ("num_logical", "ranks", "nodes"):
            object.__setattr__(self, name, checked_integer(name, getattr(self, name)))
        if self.ranks % self.nodes:
            raise ValueError(f"ranks ({self.ranks}) must be a multiple of nodes ({self.nodes})")
        given = np.asarray(self.physical_to_logical)
        table = given.astype(np.int64)
        if given.dtype.kind not in "iub" and not np.array_equal(table, given):
            raise ValueError("physical_to_logical must hold integer expert ids (-1 for an "
                             "empty slot)")
        if table.ndim != 1 or table.size == 0 or table.size % self.ranks:
            raise ValueError(f"physical_to_logical must be 1-D with a multiple of ranks "
                             f"({self.ranks}) entries, got shape {table.shape}")
        if table.min() < EMPTY or table.max() >= self.num_logical:
            raise ValueError(f"physical_to_logical holds ids outside -1..{self.num_logical - 1}")
        missing = np.flatnonzero(np.bincount(table[table >= 0], minlength=self.num_logical) == 0)
        if missing.size:
            raise ValueError(f"logical experts {missing.tolist()} have no replica")
        table.flags.writeable = False
        object.__setattr__(self, "physical_to_logical", table)

    @classmethod
    def identity(cls, num_experts: int, ranks: int, nodes: int = 1) -> "Placement":
        """Today's layout without replicas: expert e on rank e // (E // ranks)."""
        if checked_integer("num_experts", num_experts) % checked_integer("ranks", ranks):
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of ranks ({ranks})")
        return cls(num_experts, ranks, nodes, np.arange(num_experts))

    def _key(self) -> Tuple[int, int, int, bytes]:
        return self.num_logical, self.ranks, self.nodes, self.physical_to_logical.tobytes()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Placement) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.size

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ranks

    @property
    def slots(self) -> np.ndarray:
        """[ranks, slots_per_rank]: the logical expert in each of a rank's slots."""
        return self.physical_to_logical.reshape(self.ranks, self.slots_per_rank)

    def rank_of(self, physical: Any) -> Any:
        return np.asarray(physical) // self.slots_per_rank

    def node_of(self, rank: Any) -> Any:
        return np.asarray(rank) // (self.ranks // self.nodes)

    @functools.cached_property
    def replica_counts(self) -> np.ndarray:
        held = self.physical_to_logical[self.physical_to_logical >= 0]
        return np.bincount(held, minlength=self.num_logical)

    @functools.cached_property
    def logical_to_physical(self) -> Tuple[Tuple[int, ...], ...]:
        """The slots of each logical expert's replicas, in increasing order."""
        order = np.argsort(self.physical_to_logical, kind="stable")
        order = order[self.physical_to_logical[order] >= 0]
        bounds = np.cumsum(self.replica_counts)[:-1]
        return tuple(tuple(part.tolist()) for part in np.split(order, bounds))

    @functools.cached_property
    def columns(self) -> int:
        """How many columns ``replica_table`` has per (sender, expert): the
        least common multiple of the replica counts, so that every sender's
        shares are exact, at most ``MAX_COLUMNS`` (shares then rounded)."""
        return min(math.lcm(*np.unique(self.replica_counts).tolist()), MAX_COLUMNS)

    @functools.cached_property
    def replica_table(self) -> np.ndarray:
        """[ranks, num_logical, columns]: the slot each sender sends each
        logical expert's tokens to, by column; token t of a sender's call
        takes column ``t % columns``. A function of the placement alone, the
        same on every rank.

        Every replica is to receive an equal share of its expert's tokens
        (what ``rank_loads`` assumes), each sender sending ``1 / ranks`` of
        them: a sender fills the replicas on its own rank first, then those
        on its node, then any, as far as each replica's share is not yet
        full (``_shares``). A sender's columns interleave its replicas in
        those proportions, rotated by its rank so that senders with one
        token start on different replicas."""
        table = np.empty((self.ranks, self.num_logical, self.columns), dtype=np.int64)
        senders = np.arange(self.ranks)
        for expert, replicas in enumerate(self.logical_to_physical):
            replicas = np.asarray(replicas)
            where = self.rank_of(replicas)
            units = _shares(senders, where, self.node_of(senders), self.node_of(where))
            for sender, row in enumerate(units):
                table[sender, expert] = np.roll(replicas[_interleaved(row, self.columns)],
                                                -sender)
        table.flags.writeable = False
        return table

    def replica_for(self, sender_rank: int, logical_ids: Any) -> np.ndarray:
        """The physical slot each of ``logical_ids`` (one row per token:
        [T] or [T, k]) goes to from ``sender_rank`` (``replica_table``, by
        the token's row); -1 ("no expert") stays -1."""
        ids = np.asarray(logical_ids, dtype=np.int64)
        if not 0 <= sender_rank < self.ranks:
            raise ValueError(f"sender_rank {sender_rank} is not a rank of 0..{self.ranks - 1}")
        if ids.size and (ids.min() < EMPTY or ids.max() >= self.num_logical):
            raise ValueError(f"logical ids must lie in -1..{self.num_logical - 1}")
        rows = np.arange(ids.shape[0]) if ids.ndim else np.zeros((), np.int64)
        rows = (rows % self.columns).reshape(rows.shape + (1,) * max(ids.ndim - 1, 0))
        found = self.replica_table[sender_rank][np.maximum(ids, 0), rows]
        return np.where(ids >= 0, found, EMPTY)

    def rank_loads(self, load: Any) -> np.ndarray:
        """Each rank's share of ``load`` (one value per logical expert), each
        expert's load split evenly over its replicas."""
        return _rank_loads(self.slots, _load(load, self.num_logical))

    def imbalance(self, load: Any) -> float:
        """Busiest rank's load over the mean rank's (1.0 is perfect)."""
        loads = self.rank_loads(load)
        return float(loads.max() / loads.mean()) if loads.sum() > 0 else 1.0


def moves(current: Placement, new: Placement) -> List[Tuple[int, int, int]]:
    """The expert weights that must travel to go from ``current`` to ``new``:
    ``(logical, from_rank, to_rank)`` for each replica a rank gains, sent by a
    rank that holds it now (the lowest on the receiver's node, else the
    lowest). A weight that stays on its rank, in any slot, does not move."""
    if (current.num_logical, current.ranks, current.nodes) != (new.num_logical, new.ranks,
                                                               new.nodes):
        raise ValueError("moves needs two placements of the same experts, ranks and nodes")
    holders = [np.unique(current.rank_of(r)) for r in current.logical_to_physical]
    listed = []
    for rank in range(new.ranks):
        gained = set(new.slots[rank].tolist()) - set(current.slots[rank].tolist())
        for expert in sorted(e for e in gained if e >= 0):
            near = holders[expert][new.node_of(holders[expert]) == new.node_of(rank)]
            listed.append((expert, int((near if near.size else holders[expert])[0]), rank))
    return listed


def rebalance(load: Any, *, ranks: int, nodes: int = 1, redundant: int = 0,
              groups: Optional[int] = None,
              current: Union[None, Placement, Sequence[Placement]] = None,
              tolerance: float = 0.02,
              drain: Sequence[int] = ()) -> Union[Placement, List[Placement]]:
    """A placement of ``load``'s experts (1-D: one per logical expert; 2-D:
    one row per layer, and a list of placements back) on ``ranks`` ranks with
    ``redundant`` replicas beyond one per expert.

    Every rank that is not in ``drain`` gets ``ceil((E + redundant) / active
    ranks)`` slots, all filled (so ``redundant`` is rounded up); drained ranks
    get empty slots. With ``groups`` (node-limited routing: E // groups
    contiguous experts per group) dividing into ``nodes``, whole groups go to
    nodes and replicas stay on their group's node; otherwise (or with
    ``drain``) experts go anywhere. With ``current``, the placement returned
    is the one that moves the fewest weights (``moves``) among those whose
    imbalance is within ``1 + tolerance`` of the best found.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim == 2:
        currents = [None] * len(load) if current is None else list(current)
        if len(currents) != len(load):
            raise ValueError(f"current has {len(currents)} placements for {len(load)} layers")
        return [rebalance(row, ranks=ranks, nodes=nodes, redundant=redundant, groups=groups,
                          current=c, tolerance=tolerance, drain=drain)
                for row, c in zip(load, currents)]
    if load.ndim != 1:
        raise ValueError(f"load must be 1-D (one value per logical expert) or 2-D (a row per "
                         f"layer), got shape {load.shape}")
    load = _load(load, load.size)
    plan = _Rebalancing(load, checked_integer("ranks", ranks), checked_integer("nodes", nodes),
                 redundant, groups, drain)
    candidates = plan.candidates()
    best = min(candidates, key=plan.imbalance)
    if current is None:
        return plan.placement(best)
    plan.check_current(current)
    bound = plan.imbalance(best) * (1 + _tolerance(tolerance))
    options = [plan.matched(table, current.slots) for table in candidates]
    options = [plan.placement(t) for t in options if plan.imbalance(t) <= bound]
    fewest = min(len(moves(current, p)) for p in options)
    repaired = plan.repaired(current.slots, bound, fewest)
    if repaired is not None:
        options.append(plan.placement(repaired))
    return min(options, key=lambda p: (len(moves(current, p)), p.imbalance(load)))


class _Rebalancing:
    """One layer's rebalancing problem; placements in the making are
    [ranks, slots] tables of logical ids."""

    def __init__(self, load: np.ndarray, ranks: int, nodes: int, redundant: Any,
                 groups: Optional[int], drain: Sequence[int]) -> None:
        if ranks % nodes:
            raise ValueError(f"ranks ({ranks}) must be a multiple of nodes ({nodes})")
        redundant = checked_integer("redundant", redundant, least=0)
        self.drained = sorted({operator.index(r) for r in drain})
        if any(not 0 <= r < ranks for r in self.drained) or len(self.drained) == ranks:
            raise ValueError(f"drain must name some, not all, of the ranks 0..{ranks - 1}: "
                             f"got {list(drain)}")
        self.load, self.ranks, self.nodes = load, ranks, nodes
        self.active = np.setdiff1d(np.arange(ranks), self.drained)
        self.slots = -(-(load.size + redundant) // self.active.size)
        if groups is not None and (checked_integer("groups", groups) > load.size
                                   or load.size % groups):
            raise ValueError(f"groups ({groups}) must divide the {load.size} experts")
        hierarchical = groups is not None and nodes > 1 and groups % nodes == 0 and not self.drained
        self.groups = groups if hierarchical else None
        self.mean = load.sum() / ranks

    def imbalance(self, table: np.ndarray) -> float:
        loads = _rank_loads(table, self.load)
        return float(loads.max() / self.mean) if self.mean > 0 else 1.0

    def placement(self, table: np.ndarray) -> Placement:
        return Placement(self.load.size, self.ranks, self.nodes, table.ravel())

    def candidates(self) -> List[np.ndarray]:
        """Global: DeepSeek's replication and packing, then swaps that lower
        the busiest rank. Hierarchical: groups packed onto nodes, DeepSeek's
        way (the same number on each) and with as many as a node's slots
        hold, each packing also improved by swaps; then placed as in the
        global case inside every node."""
        if self.groups is None:
            table = np.full((self.ranks, self.slots), EMPTY)
            table[self.active] = _place(self.load, np.arange(self.load.size), self.active.size,
                                        self.slots)
            return [table]
        size = self.load.size // self.groups
        group_loads = self.load.reshape(self.groups, size).sum(1)
        per_node = self.ranks // self.nodes
        room = min(per_node * self.slots // size, self.groups)
        tables = []
        for capacity in sorted({self.groups // self.nodes, room}):
            # zero-load stand-ins fill the spare room, so a swap with one moves a group
            padded = np.concatenate([group_loads, np.zeros(self.nodes * capacity - self.groups)])
            first = _lpt(padded, self.nodes, capacity)
            for packing in (first, _swapped(first, padded)):
                rows = []
                for node_groups in packing:
                    node_groups = node_groups[node_groups < self.groups]
                    experts = (node_groups[:, None] * size + np.arange(size)).ravel()
                    rows.append(_place(self.load[experts], experts, per_node, self.slots))
                tables.append(np.concatenate(rows))
        return tables

    def check_current(self, current: Placement) -> None:
        if not isinstance(current, Placement):
            raise TypeError(f"current must be a Placement, got {type(current).__name__}")
        if (current.num_logical, current.ranks, current.nodes) != (self.load.size, self.ranks,
                                                                   self.nodes):
            raise ValueError(f"current places {current.num_logical} experts on {current.ranks} "
                             f"ranks in {current.nodes} nodes; the load asks for "
                             f"{self.load.size} on {self.ranks} in {self.nodes}")

    def matched(self, table: np.ndarray, current: np.ndarray) -> np.ndarray:
        """``table`` with its ranks renumbered (whole nodes, then ranks inside
        a node, when hierarchical) to keep the most of ``current``'s experts
        where they are, and kept experts in their current slots."""
        if self.groups is None:
            order = np.arange(self.ranks)
            order[self.active] = self.active[_match(table[self.active], current[self.active])]
        else:
            per_node = self.ranks // self.nodes
            by_node = table.reshape(self.nodes, -1)
            node_order = _match(by_node, current.reshape(self.nodes, -1))
            order = np.concatenate([node * per_node + _match(
                table[node * per_node:(node + 1) * per_node],
                current[target * per_node:(target + 1) * per_node])
                for node, target in zip(node_order, range(self.nodes))])
        return np.stack([_keep_slots(row, now) for row, now in zip(table[order], current)])

    def repaired(self, current: np.ndarray, bound: float, limit: int) -> Optional[np.ndarray]:
        """``current`` changed one weight at a time (a slot takes another
        expert, or two slots swap) while that lowers the busiest rank, until
        the imbalance is within ``bound``; None if it is not reached in fewer
        than ``limit`` moves, or ``current`` does not fit this plan."""
        if current.shape[1] != self.slots or (current[self.drained] != EMPTY).any() or (
                current[self.active] == EMPTY).any():
            return None
        home = self._homes(current)
        if home is None:
            return None
        node = self.active // (self.ranks // self.nodes)
        table, moved = current.copy(), 0
        while self.imbalance(table) > bound:  # drained ranks stay empty: only active rows change
            step = _best_step(table[self.active], self.load, home, node)
            if step is None or moved + step[0] >= limit:
                return None
            moved += step[0]
            active = table[self.active]
            step[1](active)
            table[self.active] = active
        return table

    def _homes(self, current: np.ndarray) -> Optional[np.ndarray]:
        """Where each expert may live: -1 anywhere (global); hierarchical, the
        node its group is on now (None if a group is spread over nodes)."""
        if self.groups is None:
            return np.full(self.load.size, EMPTY)
        node = np.repeat(np.arange(self.nodes), current.size // self.nodes)
        size = self.load.size // self.groups
        home = np.full(self.groups, EMPTY)
        for group, where in zip(current.ravel() // size, node):
            if home[group] not in (EMPTY, where):
                return None
            home[group] = where
        return np.repeat(home, size)


def _best_step(table: np.ndarray, load: np.ndarray, home: np.ndarray, node: np.ndarray):
    """The change of one slot, or else the swap of two, that lowers the
    busiest rank's load the most: (weights it moves, a function applying it),
    or None when nothing lowers it."""
    count = np.bincount(table.ravel(), minlength=load.size)
    held = np.stack([np.bincount(row, minlength=load.size) for row in table])  # [ranks, E]
    share = load / count
    loads = held @ share
    busiest = int(loads.argmax())
    best = (loads[busiest], None)
    # one slot takes expert x instead of a: a's other replicas take more, x's take less
    fewer = np.where(count > 1, load / np.maximum(count - 1, 1), np.inf)
    more = load / (count + 1)
    slots = [(busiest, s) for s in range(table.shape[1])]
    slots += [(r, s) for r in range(len(table)) for s in range(table.shape[1]) if r != busiest]
    experts_here = np.flatnonzero(held[busiest])
    for rank, slot in slots:
        a = table[rank, slot]
        if count[a] < 2:
            continue
        base = loads + held[:, a] * (fewer[a] - share[a])
        base[rank] -= fewer[a]
        candidates = np.arange(load.size) if rank == busiest else experts_here
        candidates = candidates[(candidates != a) & ((home[candidates] == EMPTY)
                                                     | (home[candidates] == node[rank]))]
        after = base[:, None] - held[:, candidates] * (share[candidates] - more[candidates])
        after[rank] += more[candidates]
        peaks = after.max(0)
        if peaks.size and peaks.min() < best[0] * (1 - 1e-12):
            x = int(candidates[peaks.argmin()])
            best = (peaks.min(), (1, functools.partial(_set, rank, slot, x)))
    if best[1] is not None:
        return best[1]
    swap = _swap(table, share[table], node)
    return None if swap is None else (2, swap)


def _set(rank: int, slot: int, expert: int, table: np.ndarray) -> None:
    table[rank, slot] = expert


def _swap(table: np.ndarray, weights: np.ndarray, node: np.ndarray):
    """The swap of one of the busiest rank's slots with a lighter slot on
    another rank of its node group (``node``) that lowers the pair's peak the
    most, as a function applying it to ``table`` (None if none does)."""
    loads = weights.sum(1)
    busiest = int(loads.argmax())
    delta = weights[busiest][:, None, None] - weights[None]  # [its slot, rank, slot]
    after = np.maximum(loads[busiest] - delta, loads[None, :, None] + delta)
    allowed = (delta > 0) & (node == node[busiest])[None, :, None]
    allowed[:, busiest] = False
    after = np.where(allowed, after, np.inf)
    i, rank, j = np.unravel_index(after.argmin(), after.shape)
    if not after[i, rank, j] < loads[busiest] * (1 - 1e-12):
        return None

    def apply(t: np.ndarray) -> None:
        t[busiest, i], t[rank, j] = t[rank, j], t[busiest, i]
    return apply


def _place(load: np.ndarray, experts: np.ndarray, ranks: int, slots: int) -> np.ndarray:
    """``experts`` (with ``load``) replicated into ``ranks * slots`` slots and
    packed onto ``ranks`` ranks: [ranks, slots] of expert ids."""
    count = _replicate(load, ranks * slots)
    replicas = np.repeat(np.arange(load.size), count)
    weights = (load / count)[replicas]
    packing = _lpt(weights, ranks, slots)
    packing = _swapped(packing, weights)
    return experts[replicas[packing]]


def _replicate(load: np.ndarray, slots: int) -> np.ndarray:
    """Replica counts filling ``slots``: each extra replica goes to the
    expert with the largest load per replica (ties to the lower id), which
    minimises the largest replica, as DeepSeek's ``replicate_experts``."""
    count = np.ones(load.size, dtype=np.int64)
    for _ in range(slots - load.size):
        count[np.argmax(load / count)] += 1
    return count


def _lpt(weights: np.ndarray, bins: int, capacity: int) -> np.ndarray:
    """Largest first, each item onto the lightest bin that has room (ties to
    the lower bin), as DeepSeek's ``balanced_packing``: [bins, capacity] of
    item indices."""
    totals, filled = np.zeros(bins), np.zeros(bins, dtype=np.int64)
    packing = np.empty((bins, capacity), dtype=np.int64)
    for item in np.argsort(-weights, kind="stable"):
        target = int(np.argmin(np.where(filled < capacity, totals, np.inf)))
        packing[target, filled[target]] = item
        totals[target] += weights[item]
        filled[target] += 1
    return packing


def _swapped(packing: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``packing`` after swaps between the heaviest bin and another that each
    lower the heavier of the two, until none does. Each swap lowers the sum
    of squared bin loads, so this ends, never raising the heaviest bin."""
    packing = packing.copy()
    same = np.zeros(len(packing), dtype=np.int64)
    while (swap := _swap(packing, weights[packing], same)) is not None:
        swap(packing)
    return packing


def _match(new: np.ndarray, current: np.ndarray) -> np.ndarray:
    """order[i]: the row of ``new`` for position i of ``current``, chosen
    greedily by the most experts in common."""
    size = max(new.max(), current.max()) + 2
    new_counts = np.stack([np.bincount(row + 1, minlength=size)[1:] for row in new])
    now_counts = np.stack([np.bincount(row + 1, minlength=size)[1:] for row in current])
    common = np.minimum(new_counts[:, None], now_counts[None]).sum(-1).astype(np.float64)
    order = np.empty(len(new), dtype=np.int64)
    for _ in range(len(new)):
        row, position = np.unravel_index(common.argmax(), common.shape)
        order[position] = row
        common[row, :] = common[:, position] = -1
    return order


def _keep_slots(row: np.ndarray, now: np.ndarray) -> np.ndarray:
    """``row``'s experts rearranged so that those ``now`` holds keep their
    slot (of the slots both have: a placement may have fewer per rank)."""
    kept = np.full_like(row, EMPTY - 1)
    left = Counter(row.tolist())
    for slot, expert in enumerate(now.tolist()[:row.size]):
        if left[expert] > 0:
            kept[slot], left[expert] = expert, left[expert] - 1
    rest = iter(sorted(left.elements()))
    return np.array([next(rest) if e == EMPTY - 1 else e for e in kept.tolist()])


def _shares(senders: np.ndarray, where: np.ndarray, sender_node: np.ndarray,
            replica_node: np.ndarray) -> np.ndarray:
    """[senders, replicas] integer units of one expert's tokens: each sender
    has ``replicas`` units (its ``1 / senders`` of the tokens), each replica
    takes ``senders`` units (its equal share). Filled greedily, a sender
    first into replicas on its rank, then on its node, then anywhere."""
    supply = np.full(senders.size, where.size)
    demand = np.full(where.size, senders.size)
    units = np.zeros((senders.size, where.size), dtype=np.int64)
    for allowed in (where[None, :] == senders[:, None],
                    replica_node[None, :] == sender_node[:, None],
                    np.ones((senders.size, where.size), dtype=bool)):
        for sender in senders:
            for replica in np.flatnonzero(allowed[sender]):
                given = min(supply[sender], demand[replica])
                units[sender, replica] += given
                supply[sender] -= given
                demand[replica] -= given
    return units


def _interleaved(units: np.ndarray, columns: int) -> np.ndarray:
    """``columns`` replica indices in proportion to ``units`` (largest
    remainders where they do not divide), interleaved (smooth weighted round
    robin) so that any run of consecutive tokens is shared about evenly."""
    exact = units * columns / units.sum()
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[:columns - counts.sum()]] += 1
    credit = np.zeros(units.size, dtype=np.int64)
    picked = np.empty(columns, dtype=np.int64)
    for column in range(columns):
        credit += counts
        picked[column] = int(np.argmax(credit))
        credit[picked[column]] -= columns
    return picked


def _rank_loads(table: np.ndarray, load: np.ndarray) -> np.ndarray:
    held = table[table >= 0]
    share = load / np.maximum(np.bincount(held, minlength=load.size), 1)
    return np.where(table >= 0, share[table], 0.0).sum(1)


def _load(load: Any, num_logical: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.shape != (num_logical,) or num_logical == 0:
        raise ValueError(f"load must be 1-D with one value per logical expert "
                         f"({num_logical}), got shape {load.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    return load


def checked_integer(name: str, value: Any, least: int = 1) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value


def _tolerance(tolerance: Any) -> float:
    tolerance = float(tolerance)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be 0 or more, got {tolerance}")
    return tolerance
