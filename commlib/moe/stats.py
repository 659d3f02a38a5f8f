"""What a dispatch did, seen from every rank: per-expert load and drops,
rank x rank traffic, bytes over and inside nodes, imbalance. The visibility
that should exist before a training run starts, not after it slows down."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class DispatchStats:
    """Global over all ranks. ``tokens_per_expert[e]``: assignments expert e
    received; ``dropped[e]``: assignments refused by its capacity;
    ``traffic[i, j]``: token payload bytes rank i sent to rank j (every hop;
    the 8k bytes of routing metadata per row are not counted);
    ``inter_node_bytes`` / ``intra_node_bytes``: traffic between ranks on
    different nodes / on the same node (a rank's copy to itself excluded).
    ``invalid``: expert ids outside [-1, E) treated as no expert (the
    fixed-capacity mode counts them; the other refuses them).

    Under a ``Placement`` the experts above are the logical ones (a
    replicated expert's slots summed: what ``rebalance`` reads), and
    ``tokens_per_slot[p]`` is what physical slot p received; without one,
    each expert is its own slot and the two are equal."""

    tokens_per_expert: np.ndarray
    dropped: np.ndarray
    traffic: np.ndarray
    inter_node_bytes: int
    intra_node_bytes: int
    tokens_per_slot: np.ndarray
    invalid: int = 0

    @property
    def imbalance(self) -> float:
        """Max over mean expert load (1.0 is perfect balance)."""
        mean = self.tokens_per_expert.mean() if self.tokens_per_expert.size else 0.0
        return float(self.tokens_per_expert.max() / mean) if mean > 0 else 1.0

    @classmethod
    def zeros(cls, num_experts: int, size: int, num_slots: Optional[int] = None
              ) -> "DispatchStats":
        slots = num_experts if num_slots is None else num_slots
        return cls(np.zeros(num_experts, np.int64), np.zeros(num_experts, np.int64),
                   np.zeros((size, size), np.int64), 0, 0, np.zeros(slots, np.int64))

    @classmethod
    def gather(cls, comm, kept: np.ndarray, dropped: np.ndarray,
               traffic: np.ndarray, invalid: int = 0,
               slot_experts: Optional[np.ndarray] = None) -> "DispatchStats":
        """Sum every rank's part (one small allreduce) and split the traffic
        by the topology. ``kept`` and ``dropped`` are per slot;
        ``slot_experts``: each slot's logical expert (a placement's
        ``physical_to_logical``), None when each expert is its own slot."""
        return cls.from_total(comm, np.asarray(comm.allreduce(
            cls.local(kept, dropped, traffic, invalid))), kept.size, slot_experts)

    @staticmethod
    def local(kept: np.ndarray, dropped: np.ndarray, traffic: np.ndarray,
              invalid: int = 0) -> np.ndarray:
        """This rank's part, as the int64 vector the ranks sum."""
        return np.concatenate([kept, dropped, traffic.reshape(-1), [invalid]]).astype(np.int64)

    @classmethod
    def from_total(cls, comm, total: np.ndarray, slots: int,
                   slot_experts: Optional[np.ndarray] = None) -> "DispatchStats":
        """The stats from the ranks' summed ``local`` vectors (summed by
        ``gather``'s allreduce, or riding a dispatch's agreement) of
        ``slots`` slots, each of the logical expert ``slot_experts`` names
        (None: each its own)."""
        size = comm.size
        matrix = total[2 * slots:-1].reshape(size, size)
        across, within = _node_masks(tuple(comm.topology.node_of_rank))
        kept, dropped = total[:slots], total[slots:2 * slots]
        return cls(_by_expert(kept, slot_experts), _by_expert(dropped, slot_experts), matrix,
                   int(matrix[across].sum()), int(matrix[within].sum()), kept,
                   int(total[-1]))

    def __add__(self, other: "DispatchStats") -> "DispatchStats":
        return DispatchStats(self.tokens_per_expert + other.tokens_per_expert,
                             self.dropped + other.dropped, self.traffic + other.traffic,
                             self.inter_node_bytes + other.inter_node_bytes,
                             self.intra_node_bytes + other.intra_node_bytes,
                             self.tokens_per_slot + other.tokens_per_slot,
                             self.invalid + other.invalid)


def _by_expert(per_slot: np.ndarray, slot_experts: Optional[np.ndarray]) -> np.ndarray:
    """Per-slot counts summed per logical expert (empty slots, -1, hold
    none). Every logical expert has a slot, so the largest id gives their
    number."""
    if slot_experts is None:
        return per_slot
    held = slot_experts >= 0
    return np.bincount(slot_experts[held], weights=per_slot[held],
                       minlength=int(slot_experts.max()) + 1).astype(np.int64)


@functools.lru_cache(maxsize=64)
def _node_masks(node_of_rank: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
    """[P, P] masks of the rank pairs on different nodes and of the distinct
    pairs on one node: made once per topology, not per dispatch (a Python
    loop over the ranks; issue 37)."""
    nodes = np.array(node_of_rank)
    across = nodes[:, None] != nodes[None, :]
    return across, ~across & ~np.eye(nodes.size, dtype=bool)
