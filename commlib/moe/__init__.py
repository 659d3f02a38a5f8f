"""Expert parallelism: routing (top-k, node-limited, bias balancing),
deduplicated dispatch and combine (flat or two-hop), capacity and load
statistics. Expert e of E lives on rank e // (E // P)."""

from .balance import BiasBalancer
from .dispatch import DROP_POLICIES, Dispatcher, DispatchHandle
from .routing import route
from .stats import DispatchStats

__all__ = ["route", "Dispatcher", "DispatchHandle", "DispatchStats", "BiasBalancer",
           "DROP_POLICIES"]
