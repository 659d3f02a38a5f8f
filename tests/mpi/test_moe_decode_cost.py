"""A flat counted dispatch + combine costs two small exchanges (the
agreements) and two payload exchanges (issue 37): the rows each peer sends
and the stats' sum ride the dispatch's agreement instead of a count
exchange and an allreduce of their own. The stats must still be the global
counts, checked against an independent count from every rank's routing."""

import numpy as np
import pytest
from mpi4py import MPI

import commlib
from commlib.moe.dispatch import Dispatcher

from conftest import all_ranks

# the exchanges of a pair between peers, at an even and an odd world size
WORLD_SIZES = (2, 3)


@pytest.mark.parametrize("capacity", [None, 0.6])
def test_flat_counted_stats_ride_the_agreement(comm, capacity):
    world = commlib.init()
    try:
        num_experts, hidden, k = 4 * comm.size, 5, 3
        rng = np.random.default_rng([7, comm.rank])
        tokens = 6 + comm.rank
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        experts = np.array([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
        experts[rng.random(experts.shape) < 0.2] = -1
        weights = rng.random((tokens, k)).astype(np.float32)
        d = Dispatcher(world, num_experts, capacity_factor=capacity)
        host = world._host
        calls = {"exchange_int64": 0, "allreduce": 0}
        for name in calls:
            original = getattr(host, name)

            def counting(*args, _name=name, _original=original, **kwargs):
                calls[_name] += 1
                return _original(*args, **kwargs)
            setattr(host, name, counting)
        expert_x, handle = d.dispatch(x, experts, weights)
        d.combine(expert_x, handle)
        for name in calls:
            delattr(host, name)  # the bound methods again
        everyone = MPI.COMM_WORLD.allgather(experts)
        per_rank = num_experts // comm.size
        requested = sum(np.bincount(e[e >= 0], minlength=num_experts) for e in everyone)
        traffic = np.array([[sum(any(v // per_rank == dest for v in row if v >= 0) for row in e)
                             for dest in range(comm.size)] for e in everyone]) * hidden * 4
        stats = handle.stats
        assert all_ranks(
            calls == {"exchange_int64": 2, "allreduce": 0}
            and np.array_equal(stats.tokens_per_expert + stats.dropped, requested)
            # rows sent before drops: exact without a capacity
            and (capacity is not None or (not stats.dropped.any()
                                          and np.array_equal(traffic, stats.traffic)
                                          and stats.intra_node_bytes
                                          == traffic.sum() - np.trace(traffic)))), (calls, stats)
    finally:
        world.free()
