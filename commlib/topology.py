"""Which node each rank runs on.

Topology is data: it is computed once, at ``init`` or ``split``, and read by
whatever needs it (two-hop dispatch, node-limited routing, diagnostics).
Nothing else in commlib guesses node boundaries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

RANKS_PER_NODE_ENV = "COMMLIB_RANKS_PER_NODE"


@dataclass(frozen=True)
class Topology:
    """The node of every rank of a communicator, seen from one rank.

    ``node_of_rank[r]`` is the node index (0 .. num_nodes-1, numbered in order
    of each node's lowest rank) of rank ``r``. ``emulated`` is True when the
    nodes come from ``ranks_per_node`` / ``COMMLIB_RANKS_PER_NODE`` instead of
    the hardware.
    """

    rank: int
    node_of_rank: Tuple[int, ...]
    emulated: bool = False

    @property
    def size(self) -> int:
        return len(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def node_of(self, rank: int) -> int:
        return self.node_of_rank[rank]

    def ranks_of(self, node: int) -> Tuple[int, ...]:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} does not exist: this topology has "
                             f"nodes 0..{self.num_nodes - 1}")
        return tuple(r for r, n in enumerate(self.node_of_rank) if n == node)

    @property
    def local_rank(self) -> int:
        return self.ranks_of(self.node).index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.ranks_of(self.node))

    @property
    def is_uniform(self) -> bool:
        """Every node has the same number of ranks."""
        sizes = {len(self.ranks_of(n)) for n in range(self.num_nodes)}
        return len(sizes) == 1

    def restrict(self, parent_ranks: Sequence[int], rank: int) -> "Topology":
        """The topology of a sub-communicator whose rank ``i`` is this
        communicator's rank ``parent_ranks[i]``: nodes keep their members,
        renumbered in order of first appearance."""
        renumber: dict = {}
        nodes = []
        for r in parent_ranks:
            nodes.append(renumber.setdefault(self.node_of_rank[r], len(renumber)))
        return Topology(rank, tuple(nodes), self.emulated)


def emulated(rank: int, size: int, ranks_per_node: int) -> Topology:
    """Nodes of ``ranks_per_node`` consecutive ranks each."""
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    if size % ranks_per_node:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {size}; "
            f"use one of {divisors} (set by the ranks_per_node argument or "
            f"{RANKS_PER_NODE_ENV})")
    return Topology(rank, tuple(r // ranks_per_node for r in range(size)), True)


def from_node_leaders(rank: int, leader_of_rank: Sequence[int]) -> Topology:
    """Topology from the lowest world rank sharing memory with each rank
    (what an allgather over ``MPI.COMM_TYPE_SHARED`` gives)."""
    renumber: dict = {}
    nodes = tuple(renumber.setdefault(leader, len(renumber)) for leader in leader_of_rank)
    return Topology(rank, nodes, False)


def ranks_per_node_from_env(explicit: Optional[int]) -> Optional[int]:
    """``explicit`` if given, else ``COMMLIB_RANKS_PER_NODE`` parsed, else None."""
    if explicit is not None:
        return explicit
    raw = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{RANKS_PER_NODE_ENV}={raw!r} is not an integer; "
                         f"set it to the number of ranks per emulated node") from None
