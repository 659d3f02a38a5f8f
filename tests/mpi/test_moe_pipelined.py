"""Pipelined two-hop dispatch (``commlib.moe.pipeline``) against one
exchange: the same expert rows, in the order the chunks deliver them, and
the same combine, gradients and stats bit for bit, whatever the chunk count
(a few, more chunks than any rank has tokens), with a rank that routes
nothing, in the counted, fixed-capacity and FP8 modes, in every array
framework (async: the micro-batch test of test_moe_modes.py).
The independent reference: flat dispatch's rows, put in the order that the
routing alone says two hops deliver them (by chunk, then the source's local
rank, which names the forwarder, then the source, then the token).

4 ranks run as 2 nodes x 2, 2 ranks as 2 nodes x 1 and 3 ranks as 3 nodes
x 1: two-hop dispatch needs nodes of one size (2 + 1 is refused, see
test_moe.py), and three nodes are where the order of a token's sums over
nodes can show."""

import numpy as np
import pytest
from mpi4py import MPI
from test_moe import (
    TOLERANCE,
    expert_maps,
    kept_by_capacity,
    make_routing,
    run_experts,
    run_fixed_experts,
)
from test_moe_modes import linear_experts

import commlib
from commlib.moe import contract, pipeline
from commlib.moe.dispatch import Dispatcher

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

# two-hop on two emulated nodes: 2 x 1 and 2 x 2
WORLD_SIZES = (2, 4)

CHUNKS = (2, 3, 64)  # 64: more chunks than any rank has tokens
# fixed capacity, capacity factor, quantize, dequantize, dtype
MODES = {"counted": (False, None, None, False, "float32"),
         "counted-capacity": (False, 0.6, None, False, "float32"),
         "counted-bfloat16": (False, None, None, False, "bfloat16"),
         "fixed": (True, None, None, False, "float32"),
         "fixed-capacity-fp8": (True, 0.6, "fp8", True, "float32"),
         "fp8-values": (False, None, "fp8", False, "float32")}


def world_for(comm):
    return commlib.init(ranks_per_node=2 if comm.size % 4 == 0 else 1)


def most_tokens(comm, tokens):
    return max(1, int(comm.allreduce(np.array([tokens]), op="max")[0]))


def host_bytes(a):
    """A NumPy copy of ``a`` (any framework; a tuple part by part) as raw
    bytes, so that equal means bit for bit."""
    if isinstance(a, tuple):
        return tuple(host_bytes(part) for part in a)
    if type(a).__module__.startswith("torch"):
        import torch
        a = a.detach().cpu().contiguous()
        return a.view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(a)).view(np.uint8)


def real_rows(expert_rows, handle):
    """Expert rows without a fixed capacity's padding, as raw bytes [rows,
    ...], expert after expert."""
    rows = host_bytes(expert_rows)
    if not handle.expert_shape:
        return rows
    counts = np.asarray(handle.tokens_per_expert).tolist()

    def unpadded(part):
        return np.concatenate([part[e, :n] for e, n in enumerate(counts)])
    return tuple(unpadded(p) for p in rows) if isinstance(rows, tuple) else unpadded(rows)


def same(a, b):
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(same, a, b))
    return a.shape == b.shape and np.array_equal(a, b)


def dispatch_everything(world, impl, mode, batch, chunks, hierarchical=True, limit=None):
    """One dispatch and, where the experts can take its rows, combine and
    both backwards, through a Dispatcher of ``chunks``; every result as
    bytes, with the stats and the chunk count the dispatch used."""
    fixed, capacity, quantize, dequantize, dtype = MODES[mode]
    num_experts = 4 * world.size
    tokens = dict(max_tokens_per_rank=limit or most_tokens(world, batch[0].shape[0])) \
        if fixed else {}
    d = Dispatcher(world, num_experts, hierarchical=hierarchical, capacity_factor=capacity,
                   **tokens)
    d.pipeline_chunks = chunks
    x = impl.asarray(batch[0], dtype)
    expert_x, handle = d.dispatch(x, impl.asarray(batch[1]), impl.asarray(batch[2]),
                                  quantize=quantize, dequantize=dequantize)
    out = {"rows": real_rows(expert_x, handle),
           "per_expert": np.asarray(handle.tokens_per_expert).tolist()}
    if quantize is None or dequantize:
        run = run_fixed_experts if fixed else run_experts
        expert_y = run(world, expert_x, handle, expert_maps(num_experts), impl, dtype)
        y = d.combine(expert_y, handle)
        d_expert_y, d_weights = d.combine_backward(expert_y, y, handle, batch[1].shape[1])
        out.update(y=host_bytes(y), y_values=impl.to_numpy(y),
                   dx=host_bytes(d.dispatch_backward(expert_y, handle)),
                   d_expert_y=real_rows(d_expert_y, handle), d_weights=host_bytes(d_weights))
    stats = d.collect_stats() if fixed else handle.stats
    out["stats"] = (stats.tokens_per_expert.tolist(), stats.dropped.tolist(),
                    stats.traffic.tolist(), stats.invalid)
    out["chunks"] = handle.route.chunks if hierarchical else None
    return out


def two_hop_order(per_expert, world, batch, mode, chunks=1):
    """Which of flat dispatch's rows each two-hop row is, expert by expert,
    in the order two hops deliver them in ``chunks`` chunks, which follows from
    everyone's routing alone: by chunk (a counted dispatch's chunk c holds
    tokens [c T / n, (c+1) T / n) of each source; a fixed capacity's, slots
    [c h / n, (c+1) h / n) of each block of h slots a source sends a
    forwarder, filled in token order), then the forwarder (the source's
    local rank), the source and the token."""
    fixed, capacity = MODES[mode][0], MODES[mode][1]
    num_experts = 4 * world.size
    local = num_experts // world.size
    everyone = MPI.COMM_WORLD.allgather(
        kept_by_capacity(batch[1], batch[2], num_experts, capacity, "probs"))
    topology = world.topology
    here = topology.node_of(world.rank)
    most = most_tokens(world, batch[0].shape[0])
    per_source = min(most, contract.capacity(most, batch[1].shape[1], num_experts, capacity,
                                             most) or most)
    block = min(most, local * len(topology.ranks_of(here)) * per_source)

    def chunk(source, token, kept):
        if not fixed:
            return ((token + 1) * chunks - 1) // max(len(kept), 1)
        slot = [t for t in range(len(kept)) if any(
            e >= 0 and topology.node_of(e // local) == here for e in kept[t])].index(token)
        return max(c for c in range(chunks) if block * c // chunks <= slot)
    order, start = [], 0
    for e, count in zip(range(world.rank * local, (world.rank + 1) * local), per_expert):
        tokens = [(chunk(s, t, kept), topology.ranks_of(topology.node_of(s)).index(s), s, t)
                  for s, kept in enumerate(everyone) for t in range(len(kept)) if e in kept[t]]
        assert len(tokens) == count  # flat's rows of e: these tokens, in (s, t) order
        order.extend(start + i for i in sorted(range(count), key=lambda i: tokens[i]))
        start += count
    return np.array(order, np.int64)


def rows_at(rows, index):
    """``rows[index]``, part by part for a tuple."""
    return tuple(p[index] for p in rows) if isinstance(rows, tuple) else rows[index]


def by_expert(rows, per_expert):
    """Each expert's rows as a sorted list of their bytes: the rows an
    expert got, whatever their order."""
    parts = rows if isinstance(rows, tuple) else (rows,)
    bounds = np.cumsum([0] + list(per_expert))
    return [sorted(b"".join(p[i].tobytes() for p in parts) for i in range(lo, hi))
            for lo, hi in zip(bounds[:-1], bounds[1:])]


def impl_cases():
    """The whole mode matrix on NumPy and torch; JAX, whose eager mode
    compiles each operation for each new shape, on one counted and one
    fixed mode, in the full tier only (10-30 s a case: every chunk count
    is new shapes); the GPU frameworks (marked, skipped without a device)
    on the modes CuPy has types for."""
    for impl in arrayimpl.params(("numpy", "torch")):
        for mode in MODES:
            yield pytest.param(impl.values[0], mode, id=f"{impl.id}-{mode}", marks=impl.marks)
    for impl in arrayimpl.params(("jax",) + arrayimpl.GPU):
        marks = [*impl.marks, *([pytest.mark.full] if impl.id == "jax" else [])]
        for mode in ("counted-capacity", "fixed"):
            yield pytest.param(impl.values[0], mode, id=f"{impl.id}-{mode}", marks=marks)


@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("case", ["plain", "no_tokens"])
@pytest.mark.parametrize("impl, mode", list(impl_cases()))
def test_pipelined_two_hop_is_one_exchange_bit_for_bit(comm, impl, mode, case):
    """Every chunk count: expert_x holds flat dispatch's rows in the order
    the chunks deliver them, d expert_y one exchange's rows in that order,
    and tokens_per_expert, y, dx, d weights and the stats are one
    exchange's, byte for byte; one exchange's y is flat's up to the order
    of float32 sums."""
    world = world_for(comm)
    try:
        batch = make_routing(world, case, 4 * world.size, seed=3)
        one = dispatch_everything(world, impl, mode, batch, chunks=1)
        flat = dispatch_everything(world, impl, mode, batch, chunks=None, hierarchical=False)
        in_one = two_hop_order(flat["per_expert"], world, batch, mode)
        ok = one["chunks"] == 1 and one["per_expert"] == flat["per_expert"] \
            and same(one["rows"], rows_at(flat["rows"], in_one))
        if "y" in one:
            scale = max(float(np.abs(flat["y_values"]).max(initial=0)), 1e-6)
            ok = ok and bool(np.abs(one["y_values"] - flat["y_values"]).max(initial=0)
                             <= TOLERANCE[MODES[mode][4]] * scale)
        for chunks in CHUNKS:
            piped = dispatch_everything(world, impl, mode, batch, chunks)
            in_chunks = two_hop_order(flat["per_expert"], world, batch, mode, chunks)
            ok = ok and piped["chunks"] == chunks \
                and same(piped["rows"], rows_at(flat["rows"], in_chunks))
            if "d_expert_y" in one:  # one exchange's, row for row
                ok = ok and same(piped["d_expert_y"], rows_at(
                    one["d_expert_y"], np.argsort(in_one)[in_chunks]))
            ok = ok and all(same(piped[key], one[key]) if key in ("y", "dx", "d_weights")
                            else piped[key] == one[key] for key in one
                            if key not in ("chunks", "y_values", "rows", "d_expert_y"))
        assert all_ranks(ok)
    finally:
        world.free()


def test_overflow_beyond_the_fixed_capacity_is_dropped_alike(comm):
    """Rank 0 dispatches more tokens than max_tokens_per_rank: pipelined,
    the same copies are dropped (the same stats) and every assignment is
    received or counted as dropped."""
    world = world_for(comm)
    try:
        num_experts = 4 * world.size
        batch = make_routing(world, "plain", num_experts, seed=5)
        limit = 4
        if world.rank != 0:
            batch = tuple(a[:limit] for a in batch)
        impl = arrayimpl.IMPLS["numpy"]
        one = dispatch_everything(world, impl, "fixed", batch, chunks=1, limit=limit)
        piped = [dispatch_everything(world, impl, "fixed", batch, chunks, limit=limit)
                 for chunks in CHUNKS]
        sent = world.allreduce(np.array([(batch[1] >= 0).sum()]))[0]
        received, dropped = sum(one["stats"][0]), sum(one["stats"][1])
        assert all_ranks(dropped > 0 and sent == received + dropped and all(
            p["stats"] == one["stats"] and p["y"].tobytes() == one["y"].tobytes()
            and by_expert(p["rows"], p["per_expert"]) == by_expert(one["rows"],
                                                                    one["per_expert"])
            for p in piped))
    finally:
        world.free()


@pytest.mark.parametrize("mode", ["counted", "fixed-fp8"])
def test_torch_gradients_are_those_of_one_exchange(comm, mode):
    """Through the torch binding (autograd), pipelined: the gradients of x,
    the weights and the expert weights are one exchange's up to float32
    rounding, not bit for bit: an expert's rows come in another order, its
    weights' gradient sums them in that order, and a matrix product may
    round a row by where it sits (a BLAS kernel's edge rows)."""
    torch = requires.module("torch")
    from commlib.bindings.torch import Dispatcher as TorchDispatcher

    world = world_for(comm)
    try:
        num_experts = 4 * world.size
        x_np, experts_np, weights_np = make_routing(world, "no_tokens", num_experts, seed=40)
        local = num_experts // world.size
        w_all = torch.from_numpy(expert_maps(num_experts).astype(np.float32))
        fixed = mode == "fixed-fp8"
        limit = dict(max_tokens_per_rank=most_tokens(world, x_np.shape[0])) if fixed else {}
        quantize = "fp8" if fixed else None

        def gradients(chunks):
            x = torch.from_numpy(x_np).requires_grad_()
            weights = torch.from_numpy(weights_np).requires_grad_()
            mine = w_all[world.rank * local:(world.rank + 1) * local].clone().requires_grad_()
            d = TorchDispatcher(world, num_experts, hierarchical=True, **limit)
            d.core.pipeline_chunks = chunks
            expert_x, handle = d.dispatch(x, torch.from_numpy(experts_np), weights,
                                          quantize=quantize, dequantize=quantize is not None)
            (d.combine(linear_experts(expert_x, handle, mine), handle) ** 2).sum().backward()
            return [t.grad.numpy() for t in (x, weights, mine)]

        reference = gradients(1)
        piped = [gradients(chunks) for chunks in CHUNKS]  # every rank runs every count
        errors = [max(float(np.abs(g - r).max(initial=0))
                      / max(float(np.abs(r).max(initial=0)), 1e-6)
                      for g, r in zip(got, reference)) for got in piped]
        assert all_ranks(max(errors) <= 1e-6), errors
    finally:
        world.free()


def test_the_default_chunk_count_follows_the_bytes(comm):
    """pipeline_chunks=None: 8, 4, 2 or 1 chunks, each holding at least
    MIN_CHUNK_BYTES of the largest inter-node block (the same count on
    every rank), and one chunk on a single node or with small blocks."""
    assert [pipeline.auto_chunks(n * pipeline.MIN_CHUNK_BYTES) for n in (0, 1, 2, 3, 7, 8, 64)] \
        == [1, 1, 2, 2, 4, 8, 8]
    world = world_for(comm)
    try:
        num_experts = 4 * world.size
        rng = np.random.default_rng([7, world.rank])
        tokens, hidden = 256, 4096  # 16 KiB rows: blocks of about 3 MiB to each other node
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        experts = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :3]
        weights = rng.random((tokens, 3)).astype(np.float32)
        chosen = {}

        def chunks_for(n, fixed):  # a fixed capacity's blocks are its capacity's: n tokens
            limit = dict(max_tokens_per_rank=n) if fixed else {}
            d = Dispatcher(world, num_experts, hierarchical=True, **limit)
            return d.dispatch(x[:n], experts[:n], weights[:n])[1].route.chunks
        for fixed in (False, True):
            chosen[fixed] = (chunks_for(tokens, fixed), chunks_for(4, fixed))
        counts = MPI.COMM_WORLD.allgather(chosen)
        away = [r for r in range(world.size) if world.topology.node_of(r)
                != world.topology.node_of(world.rank)]
        many = world.topology.num_nodes > 1 and len(away) > 0
        assert all_ranks(all(c == counts[0] for c in counts)
                         and all((big > 1) == many and little == 1
                                 for big, little in chosen.values()))
    finally:
        world.free()


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_a_bad_chunk_count_raises_on_every_rank(comm, bad):
    world = world_for(comm)
    try:
        num_experts = 4 * world.size
        batch = make_routing(world, "plain", num_experts, seed=50)
        d = Dispatcher(world, num_experts, hierarchical=True)
        if world.rank == 0:
            d.pipeline_chunks = bad
        raises_everywhere(commlib.CollectiveMismatchError, lambda: d.dispatch(*batch),
                          match="pipeline_chunks must be a positive integer")
        if world.size > 1:
            d.pipeline_chunks = 2 + (world.rank == 0)
            raises_everywhere(commlib.CollectiveMismatchError, lambda: d.dispatch(*batch),
                              match="different arguments")
    finally:
        world.free()


@pytest.mark.parametrize("fixed", [False, True], ids=["counted", "fixed"])
def test_pipelining_reads_the_device_no_more(comm, fixed):
    """Torch tensors, 3 chunks: the counted dispatch reads the device once
    (its counts), the fixed capacity never; combine and both backwards
    never; and no torch call from commlib/moe would make the host wait for
    a CUDA device (the witness of test_moe_host_syncs)."""
    requires.module("torch")
    import torch
    from test_moe_host_syncs import Reads, _torch_witness

    world = world_for(comm)
    monkeypatch = pytest.MonkeyPatch()
    try:
        num_experts = 4 * world.size
        x, experts, weights = (torch.from_numpy(a) for a in
                               make_routing(world, "no_tokens", num_experts, seed=60))
        limit = dict(max_tokens_per_rank=most_tokens(world, x.shape[0])) if fixed else {}
        d = Dispatcher(world, num_experts, hierarchical=True, capacity_factor=0.8, **limit)
        d.pipeline_chunks = 3
        d.dispatch(x, experts, weights)  # the first dispatch on a device uploads the hop maps
        reads = Reads(monkeypatch)
        with _torch_witness() as witness:
            found = []
            with reads.during(found):
                expert_x, handle = d.dispatch(x, experts, weights)
            dispatch_reads = len(found)
            with reads.during(found):
                y = d.combine(expert_x * 2, handle)
                d.dispatch_backward(expert_x, handle)
                d.combine_backward(expert_x, y, handle, experts.shape[1])
        assert all_ranks(handle.route.chunks == 3 and dispatch_reads == (0 if fixed else 1)
                         and len(found) == dispatch_reads and witness.waits == []), \
            (dispatch_reads, found, witness.waits)
    finally:
        monkeypatch.undo()
        world.free()
