"""Expert parallelism: routing (top-k, node-limited, bias balancing),
deduplicated dispatch and combine (flat or two-hop; counted, or a sync-free
fixed capacity; FP8 rows; overlap handles), capacity and load statistics,
expert placement with redundant experts (``Placement``, ``rebalance``,
``moves``), expert weights moved between placements
(``move_expert_weights``; started, ``start_expert_move``) and replicas'
gradients summed (``sum_replica_gradients``). Expert e of E lives on rank
e // (E // P), or, under a ``Dispatcher(..., placement=)``, on the ranks of
its replicas."""

from .balance import BiasBalancer
from .contract import DROP_POLICIES, QUANTIZE, MoEHandle
from .dispatch import Dispatcher
from .placement import Placement, moves, rebalance
from .relocate import PendingMove, move_expert_weights, start_expert_move, sum_replica_gradients
from .routed import DispatchHandle
from .routing import route
from .stats import DispatchStats
from .wire import PendingMoE

__all__ = ["route", "Dispatcher", "DispatchHandle", "MoEHandle", "PendingMoE", "DispatchStats",
           "BiasBalancer", "DROP_POLICIES", "QUANTIZE", "Placement", "rebalance", "moves",
           "move_expert_weights", "start_expert_move", "PendingMove", "sum_replica_gradients"]
