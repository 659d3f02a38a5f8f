"""What a dispatch did, seen from every rank: per-expert load and drops,
rank x rank traffic, bytes over and inside nodes, imbalance. The visibility
that should exist before a training run starts, not after it slows down."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Tuple

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
    fixed-capacity mode counts them; the other refuses them)."""

    tokens_per_expert: np.ndarray
    dropped: np.ndarray
    traffic: np.ndarray
    inter_node_bytes: int
    intra_node_bytes: int
    invalid: int = 0

    @property
    def imbalance(self) -> float:
        """Max over mean expert load (1.0 is perfect balance)."""
        mean = self.tokens_per_expert.mean() if self.tokens_per_expert.size else 0.0
        return float(self.tokens_per_expert.max() / mean) if mean > 0 else 1.0

    @classmethod
    def zeros(cls, num_experts: int, size: int) -> "DispatchStats":
        return cls(np.zeros(num_experts, np.int64), np.zeros(num_experts, np.int64),
                   np.zeros((size, size), np.int64), 0, 0)

    @classmethod
    def gather(cls, comm, kept: np.ndarray, dropped: np.ndarray,
               traffic: np.ndarray, invalid: int = 0) -> "DispatchStats":
        """Sum every rank's part (one small allreduce) and split the traffic
        by the topology."""
        return cls.from_total(comm, np.asarray(comm.allreduce(
            cls.local(kept, dropped, traffic, invalid))), kept.size)

    @staticmethod
    def local(kept: np.ndarray, dropped: np.ndarray, traffic: np.ndarray,
              invalid: int = 0) -> np.ndarray:
        """This rank's part, as the int64 vector the ranks sum."""
        return np.concatenate([kept, dropped, traffic.reshape(-1), [invalid]]).astype(np.int64)

    @classmethod
    def from_total(cls, comm, total: np.ndarray, experts: int) -> "DispatchStats":
        """The stats from the ranks' summed ``local`` vectors (summed by
        ``gather``'s allreduce, or riding a dispatch's agreement)."""
        size = comm.size
        matrix = total[2 * experts:-1].reshape(size, size)
        across, within = _node_masks(tuple(comm.topology.node_of_rank))
        return cls(total[:experts], total[experts:2 * experts], matrix,
                   int(matrix[across].sum()), int(matrix[within].sum()),
                   int(total[-1]))

    def __add__(self, other: "DispatchStats") -> "DispatchStats":
        return DispatchStats(self.tokens_per_expert + other.tokens_per_expert,
                             self.dropped + other.dropped, self.traffic + other.traffic,
                             self.inter_node_bytes + other.inter_node_bytes,
                             self.intra_node_bytes + other.intra_node_bytes,
                             self.invalid + other.invalid)


@functools.lru_cache(maxsize=64)
def _node_masks(node_of_rank: Tuple[int, ...]) -> Tuple[np.ndarray, np.ndarray]:
    """[P, P] masks of the rank pairs on different nodes and of the distinct
    pairs on one node: made once per topology, not per dispatch (a Python
    loop over the ranks; issue 37)."""
    nodes = np.array(node_of_rank)
    across = nodes[:, None] != nodes[None, :]
    return across, ~across & ~np.eye(nodes.size, dtype=bool)
