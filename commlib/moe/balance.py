"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv:2412.19437, 2.1.2).

Each expert carries a bias that ``route`` adds to its affinity when choosing
experts, never when weighting them. After every step an overloaded expert's
bias goes down by ``rate`` and an underloaded one's goes up, so routing drifts
towards balance without a loss term pulling against the language-model loss.
The step is a fixed size (the sign of the imbalance, not its amount), so one
freak batch cannot swing the routing.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from ..dlpack import unwrap
from .placement import checked_integer


class BiasBalancer:
    """The per-expert selection bias and its update rule.

    ``bias`` is float32 [num_experts] on the host, zeros at first. With
    ``recenter`` its mean is kept at zero: only differences between experts
    change the routing, and recentring stops the values drifting together.
    """

    def __init__(self, num_experts: int, rate: float = 1e-3, recenter: bool = True) -> None:
        self.num_experts = checked_integer("num_experts", num_experts)
        self.rate = _check_rate(rate)
        self.recenter = bool(recenter)
        self.bias = np.zeros(self.num_experts, dtype=np.float32)

    def update(self, load: Any, comm: Optional[Any] = None) -> np.ndarray:
        """Nudge the bias after a step that sent ``load[e]`` tokens to expert
        ``e``. With ``comm`` the load of every rank is summed first, so all
        ranks make the same update and keep routing alike. Returns a copy of
        the new bias (NumPy float32)."""
        if comm is None:
            counts = self._host_load(load)
        else:  # a bad load on one rank must stop every rank, not leave them waiting
            try:
                counts, problem = self._host_load(load), None
            except ValueError as error:
                counts, problem = None, error
            comm.agree("moe.BiasBalancer.update", f"num_experts={self.num_experts}",
                       problem=problem)
            counts = np.asarray(comm.allreduce(counts, op="sum"))
        step = np.sign(counts.mean() - counts).astype(np.float32)
        self.bias += np.float32(self.rate) * step
        if self.recenter:
            self.bias -= self.bias.mean()
        return self.bias.copy()

    def _host_load(self, load: Any) -> np.ndarray:
        """``load`` as a float64 NumPy array [E] (float64 sums token counts
        exactly, whatever their type and however many ranks add them)."""
        native = unwrap(load)
        data = native.data.get() if native.on_device else native.data
        counts = np.asarray(data.view(native.dtype), dtype=np.float64)
        if counts.shape != (self.num_experts,):
            raise ValueError(f"load must have shape ({self.num_experts},), tokens per expert, "
                             f"got {counts.shape}; count with bincount(experts.ravel(), "
                             f"minlength={self.num_experts})")
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise ValueError("load must hold non-negative, finite token counts per expert")
        return counts


def _check_rate(rate: Any) -> float:
    rate = float(rate)
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive, finite bias step per update, got {rate}; "
                         f"DeepSeek-V3 uses 1e-3")
    return rate
