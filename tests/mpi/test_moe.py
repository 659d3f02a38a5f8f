"""MoE dispatch and combine against a per-token loop, flat and two-hop, with
capacity dropping, conservation and inter-node byte counts checked against
an independent count. The full case matrix runs on NumPy; one demanding
case (two hops, capacity, empty slots) runs in every framework, in float32,
bfloat16 and float16."""

import math

import numpy as np
import pytest
from mpi4py import MPI

import commlib
import commlib.moe
from commlib.moe.dispatch import Dispatcher

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

# flat at odd sizes; two-hop on two nodes of 2 at 4
WORLD_SIZES = (2, 3, 4)

HIDDEN = 6
NUMPY = arrayimpl.IMPLS["numpy"]
# largest |error| allowed, relative to the largest |y|: the payload is
# rounded to the dtype on each crossing, the sums are float32. 2.5-3x the
# worst measured (NumPy and torch, counted and fixed, seeds 8-11, 2 and 3
# ranks): float32 7.8e-8, float16 6.8e-4, bfloat16 5.9e-3
TOLERANCE = {"float32": 2.5e-7, "float16": 2e-3, "bfloat16": 1.5e-2}


def expert_maps(num_experts):
    """f_e(x) = x @ W_e, the same on every rank."""
    return np.stack([np.random.default_rng(1000 + e).standard_normal((HIDDEN, HIDDEN))
                     for e in range(num_experts)]).astype(np.float64)


def run_experts(comm, expert_x, handle, maps, impl=NUMPY, dtype="float32"):
    """The local experts applied to their rows (in float64), as ``impl``'s
    ``dtype`` array."""
    local = len(handle.tokens_per_expert)
    owner = np.repeat(np.arange(local), handle.tokens_per_expert) + comm.rank * local
    rows = impl.to_numpy(expert_x).astype(np.float64)
    return impl.asarray(np.einsum("th,thg->tg", rows, maps[owner]), dtype)


def run_fixed_experts(comm, expert_x, handle, maps, impl=NUMPY, dtype="float32"):
    """The local experts on every slot of a fixed capacity's [L, slots, H]
    (padding included: combine must ignore it), as ``impl``'s ``dtype``
    array."""
    rows = impl.to_numpy(expert_x).astype(np.float64)
    local = rows.shape[0]
    owned = maps[comm.rank * local:(comm.rank + 1) * local]
    return impl.asarray(np.einsum("lsh,lhg->lsg", rows, owned), dtype)


def kept_by_capacity(experts, weights, num_experts, factor, policy):
    """Independent capacity rule: per expert, the cap heaviest (or earliest)
    assignments of this rank survive; ties go to the earlier assignment."""
    if factor is None:
        return experts
    tokens, k = experts.shape
    cap = math.ceil(tokens * k / num_experts * factor)
    kept = experts.copy()
    for e in range(num_experts):
        slots = [(t, j) for t in range(tokens) for j in range(k) if experts[t, j] == e]
        if policy == "probs":
            slots.sort(key=lambda tj: (-weights[tj], tj[0] * k + tj[1]))
        for t, j in slots[cap:]:
            kept[t, j] = -1
    return kept


def per_token_reference(x, experts, weights, maps):
    y = np.zeros((x.shape[0], HIDDEN))
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            if experts[t, j] >= 0:
                y[t] += weights[t, j] * (x[t].astype(np.float64) @ maps[experts[t, j]])
    return y


def make_routing(comm, case, num_experts, seed=0):
    rng = np.random.default_rng([seed, comm.rank])
    tokens = {"no_tokens": 0 if comm.rank == comm.size - 1 else 9}.get(case, 9 + comm.rank)
    k = {"k1": 1, "kall": num_experts}.get(case, 3)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    experts = np.array([rng.choice(num_experts, size=k, replace=False)
                        for _ in range(tokens)], dtype=np.int64).reshape(tokens, k)
    if case == "hot":
        experts[:, 0] = 0
        experts[:, 1:] = (experts[:, 1:] % (num_experts - 1)) + 1
    if case == "minus_one":
        experts[rng.random(experts.shape) < 0.3] = -1
    weights = rng.random((tokens, k)).astype(np.float32)
    return x, experts.astype(np.int64), weights


CASES = ["plain", "k1", "kall", "hot", "no_tokens", "minus_one"]


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("capacity", [None, 0.6])
@pytest.mark.parametrize("case", CASES)
def test_combine_of_dispatch_is_the_per_token_loop(comm, case, capacity, hierarchical):
    world = commlib.init(ranks_per_node=2 if comm.size % 2 == 0 else 1)
    try:
        num_experts = 4 * comm.size
        maps = expert_maps(num_experts)
        x, experts, weights = make_routing(comm, case, num_experts)
        policy = "position" if case == "hot" else "probs"
        d = Dispatcher(world, num_experts, capacity_factor=capacity, drop_policy=policy,
                       hierarchical=hierarchical)
        expert_x, handle = d.dispatch(x, experts, weights)
        y = d.combine(run_experts(world, expert_x, handle, maps), handle)
        kept = kept_by_capacity(experts, weights, num_experts, capacity, policy)
        expected = per_token_reference(x, kept, weights, maps)
        sent = world.allreduce(np.array([(experts >= 0).sum()]))[0]
        received = world.allreduce(np.array([handle.tokens_per_expert.sum()]))[0]
        stats = handle.stats
        assert all_ranks(
            y.shape == (x.shape[0], HIDDEN) and np.allclose(y, expected, atol=1e-4)
            and sent == received + stats.dropped.sum()  # conservation
            and received == stats.tokens_per_expert.sum()
            and (capacity is not None or stats.dropped.sum() == 0))
    finally:
        world.free()


def _inter_node_rows(experts_by_rank, num_experts, topology, two_hop):
    """Independent count of token rows crossing nodes: flat sends a row to
    every distinct destination rank; two-hop to every distinct node."""
    per_rank = num_experts // topology.size
    rows = 0
    for source, experts in enumerate(experts_by_rank):
        for token in experts:
            owners = {e // per_rank for e in token if e >= 0}
            if two_hop:
                nodes = {topology.node_of(r) for r in owners}
                rows += len(nodes - {topology.node_of(source)})
            else:
                rows += sum(topology.node_of(r) != topology.node_of(source) for r in owners)
    return rows


def test_two_hop_crosses_nodes_less_by_exactly_the_predicted_bytes(comm):
    if comm.size % 2:
        pytest.skip("needs an even number of ranks to emulate two nodes")
    world = commlib.init(ranks_per_node=comm.size // 2 if comm.size > 2 else 1)
    try:
        num_experts = 4 * comm.size
        x, experts, weights = make_routing(comm, "plain", num_experts, seed=3)
        row_bytes = x.itemsize * HIDDEN
        everyone = MPI.COMM_WORLD.allgather(experts)
        result = {}
        for two_hop in (False, True):
            d = Dispatcher(world, num_experts, hierarchical=two_hop)
            expert_x, handle = d.dispatch(x, experts, weights)
            d.combine(expert_x, handle)
            result[two_hop] = handle.stats.inter_node_bytes
        flat = _inter_node_rows(everyone, num_experts, world.topology, False) * row_bytes
        hier = _inter_node_rows(everyone, num_experts, world.topology, True) * row_bytes
        assert all_ranks(result[False] == flat and result[True] == hier and hier <= flat)
    finally:
        world.free()


def test_running_stats_accumulate(comm):
    num_experts = 4 * comm.size
    d = Dispatcher(comm, num_experts)
    x, experts, weights = make_routing(comm, "plain", num_experts, seed=4)
    experts = experts % num_experts
    for _ in range(3):
        d.dispatch(x, experts, weights)
    total = comm.allreduce(np.array([experts.size]))[0]
    assert all_ranks(d.stats.tokens_per_expert.sum() == 3 * total and d.stats.imbalance >= 1)


def frameworks_and_dtypes():
    """Every framework in float32, and in bfloat16 and float16 but for JAX,
    whose eager mode compiles every operation anew for each new shape."""
    cases = []
    for param in arrayimpl.params():
        impl = param.values[0]
        for dtype in ("float32",) if impl.framework == "jax" else tuple(TOLERANCE):
            cases.append(pytest.param(impl, dtype, marks=param.marks, id=f"{param.id}-{dtype}"))
    return cases


@pytest.mark.quick_sample(7)
@pytest.mark.parametrize("fixed", [False, True], ids=["counted", "fixed"])
@pytest.mark.parametrize("impl, dtype", frameworks_and_dtypes())
def test_combine_of_dispatch_in_every_framework(comm, impl, dtype, fixed):
    """Computed and returned in the caller's framework and dtype, within the
    dtype's rounding of the float32 per-token loop; under a fixed capacity
    the counts stay on the caller's device too."""
    world = commlib.init(ranks_per_node=2 if comm.size % 2 == 0 else 1)
    try:
        num_experts = 4 * comm.size
        maps = expert_maps(num_experts)
        x, experts, weights = make_routing(comm, "minus_one", num_experts, seed=8)
        # JAX compiles each operation for each new shape: one hop halves that
        d = Dispatcher(world, num_experts, capacity_factor=0.6,
                       hierarchical=impl.framework != "jax",
                       max_tokens_per_rank=16 if fixed else None)
        expert_x, handle = d.dispatch(impl.asarray(x, dtype), impl.asarray(experts),
                                      impl.asarray(weights))
        run = run_fixed_experts if fixed else run_experts
        y = d.combine(run(world, expert_x, handle, maps, impl, dtype), handle)
        expected = per_token_reference(
            x, kept_by_capacity(experts, weights, num_experts, 0.6, "probs"), weights, maps)
        error = np.abs(impl.to_numpy(y) - expected).max(initial=0)
        scale = max(1.0, np.abs(expected).max(initial=0))
        assert all_ranks(impl.is_native(expert_x) and impl.is_native(y)
                         and (not fixed or impl.is_native(handle.tokens_per_expert))
                         and impl.dtype_name(expert_x) == impl.dtype_name(y) == dtype
                         and y.shape == (x.shape[0], HIDDEN)
                         and error <= TOLERANCE[dtype] * scale), (error, scale)
    finally:
        world.free()


def test_torch_tensors_are_computed_on_by_torch(comm):
    """Dispatch and combine of torch tensors run torch's sort, gather and
    index_add (the old path converted to NumPy and ran none of them)."""
    torch = requires.module("torch")
    from torch.overrides import TorchFunctionMode

    class TorchCalls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    num_experts = 4 * comm.size
    x, experts, weights = make_routing(comm, "plain", num_experts, seed=5)
    d = Dispatcher(comm, num_experts, capacity_factor=1.0)
    with TorchCalls() as dispatched:
        expert_x, handle = d.dispatch(torch.from_numpy(x).bfloat16(), torch.from_numpy(experts),
                                      torch.from_numpy(weights))
    with TorchCalls() as combined:
        y = d.combine(expert_x * 2, handle)
    assert all_ranks({"argsort", "index_select", "searchsorted"} <= dispatched.names
                     and "index_add_" in combined.names
                     and isinstance(handle.arrival_rows, torch.Tensor)
                     and y.dtype == torch.bfloat16), (dispatched.names, combined.names)


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "two-hop"])
def test_a_dispatch_reads_the_device_once_at_every_size(comm, monkeypatch, hierarchical):
    """One ``to_host`` per dispatch (the counts the transport and the stats
    need, and the id range) and none in combine, with torch tensors, a
    capacity and a rank without tokens; for two hops the forwarders learn
    their counts from the other hosts, not from their device. (World size
    1 and the torch witness of every other device read:
    tests/test_moe_host_syncs.py.)"""
    torch = requires.module("torch")
    import commlib.moe.counted as module  # the counted path reads the device

    reads = []
    original = module.to_host
    monkeypatch.setattr(module, "to_host", lambda x: reads.append(1) or original(x))
    world = commlib.init(ranks_per_node=2 if comm.size % 2 == 0 else 1)
    try:
        num_experts = 4 * comm.size
        maps = expert_maps(num_experts)
        x, experts, weights = make_routing(comm, "no_tokens", num_experts, seed=9)
        d = Dispatcher(world, num_experts, capacity_factor=0.8, hierarchical=hierarchical)
        expert_x, handle = d.dispatch(*(torch.from_numpy(a) for a in (x, experts, weights)))
        dispatched = len(reads)
        y = d.combine(run_experts(world, expert_x, handle, maps, arrayimpl.IMPLS["torch"]),
                      handle)
        expected = per_token_reference(
            x, kept_by_capacity(experts, weights, num_experts, 0.8, "probs"), weights, maps)
        assert all_ranks(dispatched == 1 and len(reads) == 1
                         and np.allclose(y.numpy(), expected, atol=1e-4)), (dispatched, reads)
    finally:
        world.free()


# -- bad input ---------------------------------------------------------------

def test_num_experts_must_divide_over_ranks(comm):
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(comm, 2 * comm.size + 1 if comm.size > 1 else 0),
                      match="must be a positive multiple of the world size")


def test_unknown_drop_policy(comm):
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: Dispatcher(comm, comm.size, drop_policy="random"),
                      match="unknown drop_policy 'random'")


@pytest.mark.parametrize("case, message", [
    ("out_of_range", "expert indices must lie in [-1, "),
    ("weights_shape", "weights must have the shape of experts"),
    ("experts_rows", "experts must be [tokens, k]"),
    ("mixed_frameworks", "pass arrays of one framework on one device"),
])
def test_bad_routing_on_one_rank_raises_everywhere(comm, case, message):
    num_experts = 4 * comm.size
    d = Dispatcher(comm, num_experts)
    x, experts, weights = make_routing(comm, "plain", num_experts, seed=6)
    experts = experts % num_experts
    if comm.rank == comm.size - 1:
        if case == "out_of_range":
            experts[0, 0] = num_experts
        elif case == "weights_shape":
            weights = weights[:, :1]
        elif case == "mixed_frameworks":
            experts = requires.module("torch").from_numpy(experts)
        else:
            experts = experts[:-1]
    error = raises_everywhere(commlib.CollectiveMismatchError,
                              lambda: d.dispatch(x, experts, weights), match=message)
    assert f"rank {comm.size - 1}" in str(error)


@pytest.mark.parametrize("kind", ["core", "torch", "jax"])
def test_differing_options_are_named_and_a_flat_x_refused_on_every_rank(comm, kind):
    """Constructor options that differ between ranks are listed by name in
    every rank's error (they were listed by position: ``moe.Dispatcher, 8,
    None, probs, ...``); an x of one axis on the last rank is refused as
    not [tokens, hidden], naming its shape (it was reported as a
    difference in "row shape ()"). The three Dispatchers alike."""
    module = {"core": lambda: commlib.moe, "torch": lambda: requires.module(
        "commlib.bindings.torch"), "jax": lambda: requires.module("commlib.bindings.jax")}[kind]()
    convert = {"core": np.asarray, "torch": lambda a: requires.module("torch").from_numpy(a),
               "jax": lambda a: requires.module("jax").numpy.asarray(a)}[kind]
    num_experts, last = 2 * comm.size, comm.size - 1
    error = raises_everywhere(commlib.CollectiveMismatchError, lambda: module.Dispatcher(
        comm, num_experts, capacity_factor=2.0 if comm.rank == last else None),
        match="ranks called moe.Dispatcher with different arguments")
    named = [f"rank {r}: moe.Dispatcher, num_experts={num_experts}, capacity_factor="
             f"{2.0 if r == last else None}, drop_policy='probs', hierarchical=False, "
             f"max_tokens_per_rank=None, pipeline_chunks=None, placement=None"
             for r in range(comm.size)]
    assert all_ranks(all(line in str(error) for line in named)), str(error)
    d = module.Dispatcher(comm, num_experts, max_tokens_per_rank=4)
    x, experts, weights = make_routing(comm, "plain", num_experts, seed=53)
    x, experts, weights = x[:4], experts[:4, :2] % num_experts, weights[:4, :2]
    given = x[:, 0] if comm.rank == last else x
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: d.dispatch(*(convert(a) for a in (given, experts, weights))),
                      match=f"rank {last}: x must be [tokens, hidden] (a row per token; more "
                            f"trailing axes are one row's shape), got shape (4,)")


def test_combine_checks_expert_outputs_on_every_rank(comm):
    num_experts = 4 * comm.size
    d = Dispatcher(comm, num_experts)
    x, experts, weights = make_routing(comm, "plain", num_experts, seed=7)
    expert_x, handle = d.dispatch(x, experts, weights)
    bad = expert_x[:-1] if comm.rank == comm.size - 1 and len(expert_x) else expert_x
    if comm.rank == comm.size - 1 and not len(expert_x):
        bad = np.zeros((1, HIDDEN), np.float32)
    raises_everywhere(commlib.CollectiveMismatchError, lambda: d.combine(bad, handle),
                      match="expert_y must have one row per expert_x row")
    if comm.size > 1:
        other = expert_x.astype(np.float16) if comm.rank == 0 else expert_x
        raises_everywhere(commlib.CollectiveMismatchError, lambda: d.combine(other, handle),
                          match="different arguments")
    torch = requires.module("torch")
    elsewhere = torch.from_numpy(expert_x) if comm.rank == 0 else expert_x
    raises_everywhere(commlib.CollectiveMismatchError, lambda: d.combine(elsewhere, handle),
                      match="expert_y torch on cpu, the dispatch's arrays numpy on cpu")


def test_balancer_bad_load_on_one_rank_raises_everywhere(comm):
    from commlib.moe import BiasBalancer

    load = np.ones(8) if comm.rank else np.ones(7)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: BiasBalancer(8).update(load, comm), match="rank 0")
