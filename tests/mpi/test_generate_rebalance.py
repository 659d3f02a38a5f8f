"""Expert rebalancing while ``generate`` serves (``rebalance_every=``,
issue 45): a greedy run on an expert-parallel Qwen3-MoE that rebalances
every few decode steps gives the tokens of one that never does and of
``model.generate`` on one process; its placements change (replicas
appear), each move started after a step is finished, and the modules
switched, after the next one (the old placement answers it), on every rank
alike. What cannot rebalance is refused on every rank by name."""

import copy

import pytest

import commlib
import commlib.moe

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
requires.module("transformers")

from test_generate import make_model, tokens  # noqa: E402

from commlib.bindings import transformers as cht  # noqa: E402
from commlib.bindings.transformers import _expert_rebalance  # noqa: E402
from commlib.bindings.transformers._experts import expert_modules, placement_of  # noqa: E402

WORLD_SIZES = (2, 3)

NEW_TOKENS = 14


def placements(model):
    return [placement_of(module) for _, module in expert_modules(model)]


@pytest.fixture
def events(monkeypatch):
    """(what, decode steps so far, moves in flight) at each rebalance's
    start (after it) and each switch (before it)."""
    seen = []
    start, wait = _expert_rebalance.Rebalancer._start, _expert_rebalance.Rebalancer.wait

    def started(self):
        start(self)
        seen.append(("start", self.steps, len(self.moving)))

    def switched(self):
        seen.append(("switch", self.steps, len(self.moving)))
        wait(self)
    monkeypatch.setattr(_expert_rebalance.Rebalancer, "_start", started)
    monkeypatch.setattr(_expert_rebalance.Rebalancer, "wait", switched)
    return seen


@pytest.mark.parametrize("start", ["identity", "replicas"])
def test_rebalancing_midway_gives_the_tokens_of_a_run_that_never_did(comm, events, start):
    """From the identity layout, one replica per rank added (every 3 steps);
    from a placement with replicas, their number kept (every 2 steps; two
    rows)."""
    model = make_model("qwen3-moe", comm.size)
    experts = model.config.num_experts
    batch, every, redundant, placement = 1, 3, comm.size, None
    if start == "replicas":
        batch, every, redundant = 2, 2, None
        load = torch.arange(experts, 0, -1).double() ** 2
        placement = commlib.moe.rebalance(load.numpy(), ranks=comm.size, redundant=comm.size)
    ids = tokens(batch, 19, seed=3)
    want = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    plain = cht.expert_parallel(copy.deepcopy(model), comm, placement=placement)
    unmoved = cht.generate(plain, ids, comm, max_new_tokens=NEW_TOKENS)
    moving = cht.expert_parallel(copy.deepcopy(model), comm, placement=placement)
    before = placements(moving)
    got = cht.generate(moving, ids, comm, max_new_tokens=NEW_TOKENS, rebalance_every=every,
                       redundant_experts=redundant)
    after = placements(moving)
    decode_steps = NEW_TOKENS - 1
    starts = [e for e in events if e[0] == "start"]
    # each start's moves finish at the next step's end (or generate's)
    timely = all(following == ("switch", min(steps + 1, decode_steps), moves)
                 for (what, steps, moves), following in zip(events, events[1:])
                 if what == "start" and moves)
    changed = any(a != b for a, b in zip(after, before)) and all(
        p.num_physical == experts + comm.size for p in after)
    assert all_ranks(torch.equal(got, want) and torch.equal(unmoved, want)), (got, want)
    assert all_ranks(changed and timely
                     and [s[1] for s in starts] == list(range(every, decode_steps + 1, every))
                     and any(moves for _, _, moves in starts)), events


def test_the_model_serves_on_with_its_new_placement(comm):
    """After a rebalancing generate, the model holds the new placement's
    slots and a second call (without rebalancing) gives model.generate's
    tokens on a new prompt."""
    model = make_model("qwen3-moe", comm.size)
    moving = cht.expert_parallel(copy.deepcopy(model), comm)
    cht.generate(moving, tokens(1, 11, seed=4), comm, max_new_tokens=8, rebalance_every=2,
                 redundant_experts=comm.size)
    ids = tokens(1, 13, seed=5)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)
    got = cht.generate(moving, ids, comm, max_new_tokens=6)
    assert all_ranks(torch.equal(got, want) and all(p is not None for p in placements(moving)))


BAD = {
    "dense": ("needs a model made expert_parallel", dict(rebalance_every=2)),
    "compiled": ("not implemented with compile_decode",
                 dict(rebalance_every=2, compile_decode=True)),
    "zero steps": ("rebalance_every must be a number of decode steps >= 1",
                   dict(rebalance_every=0)),
    "replicas alone": ("redundant_experts applies only with rebalance_every",
                       dict(redundant_experts=2)),
    "negative replicas": ("redundant_experts must be an int >= 0",
                          dict(rebalance_every=2, redundant_experts=-1)),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_what_cannot_rebalance_is_refused_on_every_rank(comm, bad):
    match, options = BAD[bad]
    model = make_model("llama" if bad == "dense" else "qwen3-moe", comm.size)
    if bad != "dense":
        model = cht.expert_parallel(model, comm)
    raises_everywhere(commlib.CollectiveMismatchError,
                      lambda: cht.generate(model, tokens(1, 9, seed=1), comm, max_new_tokens=3,
                                           **options), match=match)
