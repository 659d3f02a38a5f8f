"""MoE dispatch and combine through an expert ``Placement`` (issue 45):
replicas from ``rebalance`` on a skewed load, and a drained rank. Beside
the conformance matrix's placement factor (``test_moe_matrix``), every
framework (the NumPy core, the torch binding, the JAX binding under
``jit``), counted and fixed capacity, flat and two-hop (core and torch):
y and the gradients equal the per-token loop of the logical experts, the
stats are per logical expert and per slot, a token stays on its own rank
when replicas there can take its share (the traffic says so), a drained
rank holds no expert rows and gets its tokens back, and bad placements are
refused on every rank.

Emulated nodes as in the matrix: 2 ranks run as 2 nodes x 1, 3 as 3 x 1,
4 as 2 x 2."""

import numpy as np
import pytest
from test_moe_matrix import (
    DISPATCHER,
    RUN,
    _close,
    _maps,
    _reference,
    kept_choices,
    placement_for,
    skewed_load,
    slot_maps,
)

import commlib
import commlib.moe as moe

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

WORLD_SIZES = (2, 3, 4)

requires.module("torch")
requires.module("jax")

HIDDEN, TOKENS, K = 8, 16, 2
MODES = {"counted": (1.0, None), "fixed": (None, TOKENS)}  # capacity factor, C
CASES = [(framework, mode, hierarchical, kind)
         for framework in ("numpy", "torch", "jax") for mode in MODES
         for hierarchical in (False, True) if not (framework == "jax" and hierarchical)
         for kind in ("replicated", "drained")]


@pytest.fixture(scope="module")
def world(comm):
    nodes = commlib.init(ranks_per_node=2 if comm.size % 4 == 0 else 1)
    yield nodes
    nodes.free()


def _routing(comm, num_experts):
    """x [T, H], experts [T, K] drawn by the skewed load (distinct per
    token, some -1), weights, the loss probe."""
    rng = np.random.default_rng([45, comm.rank])
    p = skewed_load(num_experts)
    experts = np.stack([rng.choice(num_experts, K, replace=False, p=p / p.sum())
                        for _ in range(TOKENS)]).astype(np.int64)
    experts[rng.random(experts.shape) < 0.15] = -1
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    weights = (rng.random((TOKENS, K)) + 0.1).astype(np.float32)
    probe = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    return x, experts, weights, probe


def _sent_rows(comm, experts, kept, placement, per_slot=False):
    """[P]: the rows this rank sends to each rank in a flat dispatch: a
    token once to each rank holding the slot of a kept choice, as
    ``replica_table`` picks it; ``per_slot`` (the low-latency layout of a
    fixed capacity without a capacity factor) once to each such slot."""
    slots = placement.replica_for(comm.rank, np.where(kept, experts, -1))
    ranks = np.where(slots >= 0, slots // placement.slots_per_rank, -1)
    if per_slot:
        distinct = {(t, s) for t, row in enumerate(slots) for s in row if s >= 0}
        return np.bincount([s // placement.slots_per_rank for _, s in distinct],
                           minlength=comm.size)
    return np.array([(ranks == r).any(axis=1).sum() for r in range(comm.size)])


@pytest.mark.jax_at_4  # issue 45: every framework at 4 ranks on two emulated hosts
@pytest.mark.quick_sample(8)  # each framework and mode, both placements, both paths
@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_dispatch_with_a_placement(world, case):
    """y, dx, d weights, the logical and per-slot counts, the rows each rank
    sends, and a drained rank's empty expert_x, against the per-token loop
    of the logical experts and the replica rule."""
    framework, mode, hierarchical, kind = case
    num_experts = 2 * world.size
    capacity_factor, limit = MODES[mode]
    placement = placement_for(world, kind, num_experts)
    batch = _routing(world, num_experts)
    x, experts, weights, probe = batch
    maps = _maps(num_experts)
    d = DISPATCHER[framework]()(world, num_experts, capacity_factor=capacity_factor,
                                max_tokens_per_rank=limit, hierarchical=hierarchical,
                                placement=placement)
    y, dx, dw, handle, _ = RUN[framework](world, d, batch,
                                          slot_maps(maps, placement, world.rank, world.size),
                                          None, "sync")
    want_y, want_dx, want_dw, kept, dropped = _reference(x, experts, weights, probe, maps,
                                                         capacity_factor, None)
    stats = d.collect_stats() if handle is None or handle.stats is None else handle.stats
    # the kept choices, per slot as this rank's replica table sends them
    kept_here = kept_choices(experts, weights, capacity_factor, num_experts)
    slots = placement.replica_for(world.rank, np.where(kept_here, experts, -1))
    per_slot = np.bincount(slots[slots >= 0], minlength=placement.num_physical)
    ok = (_close(y, want_y)
          and np.array_equal(stats.tokens_per_expert, world.allreduce(kept))
          and np.array_equal(stats.dropped, world.allreduce(dropped))
          and np.array_equal(stats.tokens_per_slot, world.allreduce(per_slot)))
    if dx is not None:
        ok = ok and _close(dx, want_dx) and _close(dw, want_dw)
    if framework != "jax" and not hierarchical:  # the rows each rank sent, rank by rank
        ok = ok and np.array_equal(stats.traffic[world.rank] // (HIDDEN * 4),
                                   _sent_rows(world, experts, kept_here, placement,
                                              per_slot=mode == "fixed"))
    if handle is not None and (placement.slots[world.rank] < 0).all():
        ok = ok and int(np.asarray(handle.tokens_per_expert).sum()) == 0  # drained
    assert all_ranks(ok)


def test_a_replica_on_the_senders_rank_keeps_the_token_home(world):
    """A token whose every choice has replicas on its own rank that can take
    all of this rank's share of it (held * ranks >= replicas: each replica
    takes an equal share) sends no row to another rank: each rank's tokens
    choose such logical experts, and every row stays home (the traffic
    counts it)."""
    num_experts = 2 * world.size
    placement = placement_for(world, "replicated", num_experts)
    here = placement.slots[world.rank]
    held = np.bincount(here[here >= 0], minlength=num_experts)
    mine = np.flatnonzero((held > 0) & (held * world.size >= placement.replica_counts))
    assert all_ranks(mine.size > 0)
    experts = np.tile(np.pad(mine, (0, here.size - mine.size), constant_values=-1),
                      (TOKENS, 1))
    x = np.ones((TOKENS, HIDDEN), np.float32)
    d = moe.Dispatcher(world, num_experts, placement=placement)
    _, handle = d.dispatch(x, experts, np.ones(experts.shape, np.float32))
    off_rank = handle.stats.traffic - np.diag(np.diag(handle.stats.traffic))
    home = int(handle.stats.traffic[world.rank, world.rank]) // (HIDDEN * 4)
    assert all_ranks(off_rank.sum() == 0 and home == TOKENS
                     and int(np.asarray(handle.tokens_per_expert).sum()) == TOKENS * mine.size)


@pytest.mark.parametrize("framework", ["numpy", "jax"])
def test_bad_placements_are_refused_on_every_rank(world, framework):
    """A placement for another world size, num_experts other than its
    num_logical, and ranks holding different placements: refused by the
    constructor on every rank, with the problem named."""
    num_experts = 2 * world.size
    Dispatcher = DISPATCHER[framework]()
    good = placement_for(world, "replicated", num_experts)
    other_world = moe.rebalance(skewed_load(num_experts), ranks=world.size + 1, redundant=1)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(world, num_experts, placement=other_world),
                      match=f"the placement is for {world.size + 1} ranks")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(world, num_experts + 1, placement=good),
                      match="must equal the placement's num_logical")
    mine = good if world.rank else placement_for(world, "drained", num_experts)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(world, num_experts, placement=mine),
                      match="different arguments")


@pytest.mark.parametrize("impl", arrayimpl.params(names=("cupy", "torch-cuda")))
def test_a_placement_on_the_gpu(world, impl):
    """The core Dispatcher through a placement with GPU arrays (the replica
    table copied beside them), counted and fixed: y equals the per-token
    loop, expert_x and y stay on the GPU; and a move of expert weights
    between two placements arrives bitwise as on the host."""
    num_experts = 2 * world.size
    placement = placement_for(world, "replicated", num_experts)
    x, experts, weights, _ = _routing(world, num_experts)
    maps = _maps(num_experts)
    mine = slot_maps(maps, placement, world.rank, world.size)
    want = _reference(x, experts, weights, np.zeros_like(x), maps, None, None)[0]
    ok = True
    for limit in (None, TOKENS):
        d = moe.Dispatcher(world, num_experts, max_tokens_per_rank=limit, placement=placement)
        expert_x, handle = d.dispatch(impl.asarray(x), impl.asarray(experts),
                                      impl.asarray(weights))
        rows = impl.to_numpy(expert_x)
        if limit is None:
            ends = np.cumsum(handle.tokens_per_expert)  # counted: on the host
            expert_y = np.concatenate([part @ mine[j] for j, part
                                       in enumerate(np.split(rows, ends[:-1]))])
        else:
            expert_y = np.einsum("lsh,lhg->lsg", rows, mine)
        y = d.combine(impl.asarray(expert_y.astype(np.float32)), handle)
        ok = ok and impl.is_native(expert_x) and impl.is_native(y) \
            and _close(impl.to_numpy(y), want)
    new = moe.rebalance(skewed_load(num_experts)[::-1], ranks=world.size,
                        nodes=placement.nodes, redundant=world.size, current=placement)
    weights_by_slot = np.stack([np.full((3, 5), float(e)) for e in placement.slots[world.rank]])
    on_host = moe.move_expert_weights(world, weights_by_slot, placement, new)
    on_gpu = moe.move_expert_weights(world, impl.asarray(weights_by_slot), placement, new)
    assert all_ranks(ok and impl.is_native(on_gpu)
                     and np.array_equal(impl.to_numpy(on_gpu), on_host))
