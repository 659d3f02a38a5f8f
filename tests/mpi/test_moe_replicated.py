"""MoE over tokens every rank holds (decode under context parallelism,
``commlib.moe.replicated``): every rank gets the per-token reference, the
same bits everywhere, each token dispatched once (the stats count T * k
assignments, not P * T * k), counted and fixed capacity, flat and two-hop,
in every framework, with fewer tokens than ranks."""

import numpy as np
import pytest
from mpi4py import MPI
from test_moe import HIDDEN, expert_maps, per_token_reference

import commlib
from commlib.moe import Dispatcher
from commlib.moe.replicated import everyones, my_share, replicated_moe, share_size

import arrayimpl
from conftest import all_ranks

# each token dispatched once, at even and odd sizes
WORLD_SIZES = (2, 3)


def routing(tokens, num_experts, k=3, seed=9):
    """The same tokens and routing on every rank."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float32)
    experts = np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k].astype(np.int64)
    return x, experts, rng.random((tokens, k)).astype(np.float32)


def linear(maps, comm, impl):
    """Each local expert a matrix, applied to its rows (counted [rows, H],
    or fixed [local, slots, H]), in float64, back in x's framework."""
    def run(expert_x, handle):
        rows = impl.to_numpy(expert_x).astype(np.float64)
        local = maps.shape[0] // comm.size
        owned = maps[comm.rank * local:(comm.rank + 1) * local]
        if rows.ndim == 3:
            return impl.asarray(np.einsum("lsh,lhg->lsg", rows, owned), "float32")
        owner = np.repeat(np.arange(local), np.asarray(handle.tokens_per_expert))
        return impl.asarray(np.einsum("th,thg->tg", rows, owned[owner]), "float32")
    return run


@pytest.mark.quick_sample(4)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("fixed", [False, True], ids=["counted", "fixed"])
@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "two-hop"])
@pytest.mark.parametrize("impl", arrayimpl.params(("numpy", "torch", "jax")))
def test_every_rank_gets_every_token_dispatched_once(comm, impl, hierarchical, fixed, tokens):
    world = commlib.init(ranks_per_node=2 if comm.size % 2 == 0 else 1)
    try:
        num_experts = 4 * world.size
        maps = expert_maps(num_experts)
        x, experts, weights = routing(tokens, num_experts)
        limit = dict(max_tokens_per_rank=share_size(tokens, world.size)) if fixed else {}
        d = Dispatcher(world, num_experts, hierarchical=hierarchical, **limit)
        y = replicated_moe(d, impl.asarray(x), impl.asarray(experts), impl.asarray(weights),
                           linear(maps, world, impl))
        got = impl.to_numpy(y)
        stats = d.collect_stats() if fixed else d.stats
        everyone = MPI.COMM_WORLD.allgather(got.tobytes())
        expected = per_token_reference(x, experts, weights, maps)
        assert all_ranks(impl.is_native(y) and np.allclose(got, expected, atol=1e-4)
                         and len(set(everyone)) == 1
                         and stats.tokens_per_expert.sum() == experts.size)
    finally:
        world.free()


@pytest.mark.parametrize("tokens", [0, 1, 5, 8])
def test_the_shares_cover_every_token_once(comm, tokens):
    """Rank r's share is tokens r, r + P, ...; gathered back they are the
    tokens in order, on every rank."""
    x = np.arange(tokens * 3, dtype=np.float32).reshape(tokens, 3)
    share = my_share(x, comm)
    back = everyones(share, comm, tokens)
    assert all_ranks(share.shape[0] <= share_size(tokens, comm.size)
                     and np.array_equal(back, x))
