"""Expert weights moved between placements, and replicas' gradients summed
(issue 45): ``move_expert_weights`` delivers every slot of the new
placement its logical expert's original weights, bitwise, for placement
changes ``rebalance`` makes (identity to replicated, replicated to
rebalanced from it, to and from a drained rank), several arrays of
different dtypes and shapes in one exchange, in NumPy, torch and JAX;
the bytes on the wire are exactly the weights that move, and none when
nothing does; a started move (``start_expert_move``) lets other
collectives run before its ``wait()``. ``sum_replica_gradients`` equals the sum over replicas
computed from every rank's slots, and leaves replicas bitwise equal. Bad
input is refused on every rank.

Emulated nodes as in test_moe_placement: 4 ranks run as 2 nodes x 2. The
quick tier runs NumPy and torch; JAX and a real Adam step are the full
tier's."""

import math

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import commlib
import commlib.moe as moe
from commlib.tools.simulate import zipf_popularity

import requires
from conftest import all_ranks, raises_everywhere

WORLD_SIZES = (2, 3, 4)

requires.module("torch")
jnp = requires.module("jax").numpy

# JAX's eager ops compile per shape (15 s here): the full tier's
FRAMEWORKS = ("numpy", "torch", pytest.param("jax", marks=pytest.mark.full))
SHAPES = {"w_in": ((3, 4), "float32"), "w_out": ((5,), "bfloat16"), "step": ((), "float32")}


@pytest.fixture(scope="module")
def world(comm):
    nodes = commlib.init(ranks_per_node=2 if comm.size % 4 == 0 else 1)
    yield nodes
    nodes.free()


class _CountingComm:
    """The communicator, counting the bytes handed to alltoallv (started or not)."""

    def __init__(self, comm):
        self._comm, self.sent, self.exchanges = comm, 0, 0

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _count(self, x):
        self.sent += math.prod(x.shape) * x.dtype.itemsize
        self.exchanges += 1
        return x

    def alltoallv(self, x, *args):
        return self._comm.alltoallv(self._count(x), *args)

    def alltoallv_async(self, x, *args):
        return self._comm.alltoallv_async(self._count(x), *args)


def _placements(world):
    """(name, current, new) pairs made by ``rebalance``."""
    ranks, nodes = world.size, world.topology.num_nodes
    experts = 2 * ranks
    identity = moe.Placement.identity(experts, ranks, nodes)
    first, second = (zipf_popularity(experts, 1.2, seed) for seed in (1, 2))
    replicated = moe.rebalance(first, ranks=ranks, nodes=nodes, redundant=ranks)
    rebalanced = moe.rebalance(second, ranks=ranks, nodes=nodes, redundant=ranks,
                               current=replicated)
    drained = moe.rebalance(second, ranks=ranks, nodes=nodes, redundant=ranks,
                            drain=(ranks - 1,))
    return [("identity->replicated", identity, replicated),
            ("replicated->rebalanced", replicated, rebalanced),
            ("replicated->drained", replicated, drained),
            ("drained->identity", drained, identity)]


def _experts(num_logical):
    """Every logical expert's weights, the same on every rank: name -> [E, ...]."""
    rng = np.random.default_rng(7)
    return {name: rng.standard_normal((num_logical,) + shape).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        for name, (shape, dtype) in SHAPES.items()}


def _by_slot(table, slots):
    """``table`` [E, ...] laid out by ``slots`` (empty slots: 9, never read)."""
    rows = table[np.maximum(slots, 0)].copy()
    rows[slots < 0] = 9
    return rows


def _to(framework, array):
    if framework == "torch":
        import torch
        if array.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    if framework == "jax":
        import jax.numpy as jnp
        return jnp.asarray(array)
    return array


def _from(array):
    if type(array).__module__ == "torch":
        import torch
        if array.dtype == torch.bfloat16:
            return array.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return array.numpy()
    return np.asarray(array)


def _bits(array):
    return np.ascontiguousarray(array).view(np.uint8)


def _mine(world, framework, table, placement):
    return {name: _to(framework, _by_slot(rows, placement.slots[world.rank]))
            for name, rows in table.items()}


@pytest.mark.parametrize("framework, in_place", [
    ("numpy", False), ("torch", False), pytest.param("jax", False, marks=pytest.mark.full),
    ("numpy", True), ("torch", True)])  # JAX in place: refused
def test_weights_arrive_bitwise_and_only_what_moves_travels(world, framework, in_place):
    """Every placement pair (in place: those with as many slots per rank,
    the arrays given written and returned)."""
    pairs = [p for p in _placements(world)
             if not in_place or p[1].slots_per_rank == p[2].slots_per_rank]
    assert pairs
    for name, current, new in pairs:
        table = _experts(current.num_logical)
        counting = _CountingComm(world)
        given = _mine(world, framework, table, current)
        moved = moe.move_expert_weights(counting, given, current, new, in_place=in_place)
        assert all_ranks(not in_place or moved is given and all(
            moved[key] is given[key] for key in given)), name
        slots = new.slots[world.rank]
        expected = {key: np.where((slots >= 0).reshape((-1,) + (1,) * (rows.ndim - 1)),
                                  rows[np.maximum(slots, 0)], 0).astype(rows.dtype)
                    for key, rows in table.items()}
        ok = list(moved) == list(table) and all(
            type(moved[key]) is type(_to(framework, expected[key]))
            and np.array_equal(_bits(_from(moved[key])), _bits(expected[key]))
            for key in table)
        assert all_ranks(ok), name
        # the wire carries each expert a rank gains and holds nowhere now, once
        row_bytes = sum(rows[0].nbytes for rows in table.values())
        gained = sum(len(set(new.slots[r].tolist()) - set(current.slots[r].tolist()) - {-1})
                     for r in range(world.size))
        assert gained, name
        sent = MPI.COMM_WORLD.allreduce(counting.sent)
        assert sent == gained * row_bytes and counting.exchanges == 1, (name, sent, gained)


@pytest.mark.parametrize("started", [False, True], ids=["move", "started"])
def test_an_in_place_move_returns_the_parameters_it_was_given(world, started):
    """``in_place=True`` hands back the very objects given: a dict of torch
    ``nn.Parameter``s is that dict of those Parameters, one Parameter that
    Parameter, still requiring their gradients and holding the new layout,
    so rebinding the result onto the module keeps its Parameters (and their
    gradients). Before, the result was a detached tensor sharing the
    Parameter's storage: ``is`` False, ``requires_grad`` False."""
    torch = requires.module("torch")
    _, current, new = _placements(world)[1]  # as many slots per rank in both
    table = _experts(current.num_logical)["w_in"]
    layer = torch.nn.Module()
    layer.w_in = torch.nn.Parameter(torch.from_numpy(_by_slot(table, current.slots[world.rank])))
    layer.bias = torch.nn.Parameter(torch.zeros(current.slots_per_rank, 2))

    def move(weights, before, after):
        if started:
            return moe.start_expert_move(world, weights, before, after, in_place=True).wait()
        return moe.move_expert_weights(world, weights, before, after, in_place=True)
    given = {"w_in": layer.w_in, "bias": layer.bias}
    moved = move(given, current, new)
    layer.w_in, layer.bias = moved["w_in"], moved["bias"]
    held = new.slots[world.rank] >= 0
    ok = (moved is given and moved["w_in"] is given["w_in"] and moved["bias"] is given["bias"]
          and all(p.requires_grad and isinstance(p, torch.nn.Parameter) for p in moved.values())
          and np.array_equal(layer.w_in.detach().numpy()[held],
                             table[new.slots[world.rank][held]])
          and set(dict(layer.named_parameters())) == {"w_in", "bias"})
    back = move(layer.w_in, new, current)
    (layer.w_in.sum() + layer.bias.sum()).backward()
    was = current.slots[world.rank]
    ok = ok and back is layer.w_in and np.array_equal(back.detach().numpy()[was >= 0],
                                                      table[was[was >= 0]]) \
        and layer.w_in.grad is not None and layer.bias.grad is not None
    assert all_ranks(ok)


def test_a_single_array_and_nothing_sent_when_nothing_moves(world):
    _, current, _ = _placements(world)[1]
    table = _experts(current.num_logical)["w_in"]
    counting = _CountingComm(world)
    mine = _by_slot(table, current.slots[world.rank])
    same = moe.move_expert_weights(counting, mine, current, current)
    assert all_ranks(np.array_equal(same, mine) and counting.exchanges == 0)
    # a replica a rank already holds is copied, not sent: slots only reordered
    shuffled = moe.Placement(current.num_logical, current.ranks, current.nodes,
                             current.slots[:, ::-1].ravel())
    reordered = moe.move_expert_weights(counting, mine, current, shuffled)
    assert all_ranks(np.array_equal(reordered, mine[::-1]) and counting.exchanges == 0)


def test_a_started_move_lets_other_collectives_run_until_it_finishes(world):
    """``start_expert_move`` returns with the rows on the wire; collectives in
    between (a server answering with the old weights: its dispatch's
    ``alltoallv``) run and return their own rows; ``wait()`` gives what
    ``move_expert_weights`` gives, once."""
    _, current, new = _placements(world)[1]
    mine = _mine(world, "torch", _experts(current.num_logical), current)
    pending = moe.start_expert_move(world, mine, current, new)
    ids = np.full((world.size, 2), world.rank, np.int64)
    answered, _ = world.alltoallv(ids, np.ones(world.size, np.int64))
    moved = pending.wait()
    direct = moe.move_expert_weights(world, mine, current, new)
    assert all_ranks(np.array_equal(answered, np.repeat(np.arange(world.size)[:, None], 2, 1))
                     and all(np.array_equal(_bits(_from(moved[k])), _bits(_from(direct[k])))
                             for k in direct))
    with pytest.raises(RuntimeError, match="already waited for"):
        pending.wait()


@pytest.mark.full  # torch.optim's first step costs 4 s of imports
def test_optimizer_state_moves_with_the_weights(world):
    """Adam's state is more arrays laid out by slot: it follows its weights.
    The reference: the same Adam step on every logical expert's table
    (elementwise, so each slot's numbers are its expert's, bitwise)."""
    import torch
    _, current, new = _placements(world)[0]
    table = _experts(current.num_logical)["w_in"]

    def stepped(rows):
        weights = torch.nn.Parameter(torch.from_numpy(rows))
        adam = torch.optim.Adam([weights])
        weights.grad = weights.detach() * 2
        adam.step()
        return {"w": weights, **{key: adam.state[weights][key] for key in ("exp_avg",
                                                                             "exp_avg_sq")}}
    moved = moe.move_expert_weights(world, stepped(_by_slot(table, current.slots[world.rank])),
                                    current, new)
    reference = stepped(table.copy())
    assert all_ranks(all(np.array_equal(moved[key].numpy(),
                                        reference[key].detach().numpy()[new.slots[world.rank]])
                         for key in reference) and not moved["w"].requires_grad)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_replica_gradients_summed(world, framework):
    for name, _, placement in _placements(world)[:3]:
        rng = np.random.default_rng(11)
        grads = {key: rng.standard_normal((placement.num_physical,) + shape).astype(
            ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
            for key, (shape, dtype) in SHAPES.items()}
        spr = placement.slots_per_rank
        mine = {key: _to(framework, g[world.rank * spr:(world.rank + 1) * spr].copy())
                for key, g in grads.items()}
        counting = _CountingComm(world)
        summed = moe.sum_replica_gradients(counting, mine, placement)
        for key, g in grads.items():
            # the reference: each rank's replicas summed in slot order, then those partial
            # sums (in the gradients' dtype) in rank order, in float32
            expected = np.zeros_like(g[:spr])
            for j, e in enumerate(placement.slots[world.rank].tolist()):
                if e >= 0:
                    total = np.zeros(g.shape[1:], np.float32)
                    for r in range(world.size):
                        on_r = [p for p in placement.logical_to_physical[e] if p // spr == r]
                        if on_r:
                            partial = sum(g[p].astype(np.float32) for p in on_r)
                            total = total + np.asarray(partial).astype(g.dtype).astype(np.float32)
                    expected[j] = total.astype(g.dtype)
            got = _from(summed[key])
            assert all_ranks(np.array_equal(_bits(got), _bits(expected))), (name, key)
            # every replica holds the same bits
            every = np.concatenate(MPI.COMM_WORLD.allgather(got))
            assert all(np.array_equal(_bits(every[list(slots)]),
                                      _bits(np.repeat(every[slots[0]][None], len(slots), 0)))
                       for slots in placement.logical_to_physical), (name, key)
        # the wire: c (c - 1) rows for an expert with replicas on c ranks
        row_bytes = sum(g[0].nbytes for g in grads.values())
        ranks = [len(set(placement.rank_of(np.asarray(s)).tolist()))
                 for s in placement.logical_to_physical]
        rows = sum(c * (c - 1) for c in ranks)
        assert MPI.COMM_WORLD.allreduce(counting.sent) == rows * row_bytes, name


def test_bad_input_refused_on_every_rank(world):
    _, current, new = _placements(world)[0]
    table = _experts(current.num_logical)
    mine = _mine(world, "numpy", table, current)
    elsewhere = moe.Placement.identity(2 * (world.size + 1), world.size + 1)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(world, mine, current, elsewhere),
                      match="world size")
    other = moe.rebalance(zipf_popularity(current.num_logical, 1.2, 3), ranks=world.size,
                          nodes=world.topology.num_nodes, redundant=2 * world.size)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(
                          world, mine, current, other if world.rank == 0 else new),
                      match="different arguments")
    short = dict(mine, w_in=mine["w_in"][1:]) if world.rank == world.size - 1 else mine
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(world, short, current, new),
                      match="leading size")
    retyped = dict(mine, w_in=mine["w_in"].astype(np.float64)) if world.rank == 0 else mine
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(world, retyped, current, new),
                      match="different arguments")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(world, mine, current, new, in_place=True),
                      match="as many slots per rank")
    _, replicated, rebalanced = _placements(world)[1]
    frozen = {key: jnp.asarray(rows) for key, rows in _mine(world, "numpy", table,
                                                              replicated).items()}
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.move_expert_weights(world, frozen, replicated, rebalanced,
                                                      in_place=True),
                      match="JAX array")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.sum_replica_gradients(world, mine, new),
                      match="leading size")
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: moe.sum_replica_gradients(world, mine, "identity"),
                      match="Placement")
