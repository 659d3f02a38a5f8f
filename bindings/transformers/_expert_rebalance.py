"""Expert rebalancing while ``generate`` serves (``rebalance_every=``, issue
45), as vLLM's EPLB does it (``--enable-eplb``, ``step_interval``,
``num_redundant_experts``): every ``rebalance_every`` decode steps each
expert-parallel experts module's load since its last rebalance (its
Dispatchers' statistics, summed over the ranks, so the same everywhere)
chooses a placement (``commlib.moe.rebalance`` from the current one: the
fewest weights moved for a balance within its tolerance). The weights that
move start travelling (``start_expert_move``) and the old placement answers
the next decode step; after it every rank finishes the moves and switches
(the parameters take the new slots, overwriting only the slots that change
where the slot count stays, and the Dispatchers are made for the new
placement). Every rank counts the same steps, so every rank switches at
the same one; a placement only changes which rank computes an expert, not
what it computes, so the tokens are those of a run that never rebalanced.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
from torch import nn

from commlib.moe import PendingMove, Placement, rebalance, start_expert_move

from ._experts import (
    decode_dispatchers,
    dispatcher_of,
    expert_modules,
    expert_weights,
    placement_of,
    relayout,
)

__all__ = ["Rebalancer"]


class Rebalancer:
    """One generate call's rebalancing of ``model``'s experts over ``comm``
    every ``every`` decode steps, with ``redundant`` replicas beyond one per
    expert (None: as many as each module's placement has now)."""

    def __init__(self, model: nn.Module, comm, every: int, redundant: Optional[int]):
        self.comm, self.every, self.redundant = comm, every, redundant
        self.modules = [module for _, module in expert_modules(model)]
        self.steps = 0
        self.moving: List[Tuple[nn.Module, Placement, PendingMove]] = []
        # what each module's main Dispatcher had counted at its last rebalance
        self.counted: Dict[int, np.ndarray] = {
            id(m): np.zeros(m.num_experts, np.int64) for m in self.modules}
        for module in self.modules:  # the window opens: earlier calls' counts left out
            self._load(module)

    def after_step(self) -> None:
        """After a decode step: moves started one step ago finish and the
        modules switch; every ``every`` steps, new moves start."""
        self.steps += 1
        self.wait()
        if self.steps % self.every == 0:
            self._start()

    def wait(self) -> None:
        """The moves in flight arrive, and their modules switch (collective)."""
        moving, self.moving = self.moving, []
        for module, placement, pending in moving:
            relayout(module, placement, pending.wait())
            self.counted[id(module)] = np.zeros(module.num_experts, np.int64)

    def _start(self) -> None:
        for module in self.modules:
            current = placement_of(module) or Placement.identity(
                module.num_experts, self.comm.size, self.comm.topology.num_nodes)
            redundant = current.num_physical - current.num_logical \
                if self.redundant is None else self.redundant
            new = rebalance(self._load(module), ranks=self.comm.size, nodes=current.nodes,
                            redundant=redundant, current=current)
            if new != current:  # as many slots: the changed ones overwritten, no second copy
                self.moving.append((module, new, start_expert_move(
                    self.comm, expert_weights(module), current, new,
                    in_place=new.slots_per_rank == current.slots_per_rank)))

    def _load(self, module: nn.Module) -> np.ndarray:
        """The module's tokens per logical expert since its last rebalance:
        its Dispatcher's (prefill) and its decode Dispatchers' (collective:
        a fixed-capacity Dispatcher's counts are collected here)."""
        main = dispatcher_of(module)
        if main.core.max_tokens_per_rank is not None:
            main.collect_stats()
        total = np.array(main.stats.tokens_per_expert)
        load = total - self.counted[id(module)]
        self.counted[id(module)] = total
        for decode in decode_dispatchers(module):
            load = load + decode.collect_stats().tokens_per_expert
        return load
