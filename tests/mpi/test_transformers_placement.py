"""Expert placement with replicas in transformers MoE models
(``expert_parallel(..., placement=)``, issue 45) against the unsharded
model, in float64 (the loss too: transformers' own casts the logits to
float32).

Data parallel plus expert parallel as in test_transformers_moe: each rank
holds its own batch rows, its loss scaled by 1/P; the reference is the
unsharded model with eager experts on every rank's rows. The placements come
from ``rebalance`` on a skewed load: one redundant expert per rank, the same
with rank 1 drained, and one placement per layer. Three SGD steps with
momentum, each after ``allreduce_gradients`` (which sums a replicated
expert's gradients over its replicas): the loss, every gradient and every
weight (each slot of each rank against its logical expert's, an empty slot
zero) equal the reference's within the MoE combine's float32 sums (1e-6 of
scale; docs/architecture.md, precision), and every replica of an expert
holds the same bits as the others after each step. The experts classes
whose flags those two families do not use (GPT-OSS, NemotronH, MuseSpark)
match the unsharded module under a placement. Bad placements are refused
on every rank, the model unchanged.
"""

import copy

import numpy as np
import pytest

import requires
from conftest import all_ranks, raises_everywhere

torch = requires.module("torch")
transformers = requires.module("transformers")

from test_transformers_moe import (  # noqa: E402
    EXPERTS,
    FAMILIES,
    FEATURES,
    ROWS_PER_RANK,
    SEQ,
    VOCAB,
    MuseSparkExperts,
    causal_lm,
)

import commlib.moe as moe  # noqa: E402
from commlib.bindings.transformers._experts import EXPERT_PARALLEL, expert_parallel  # noqa: E402
from commlib.bindings.transformers._gradients import allreduce_gradients  # noqa: E402
from commlib.tools.simulate import zipf_popularity  # noqa: E402

WORLD_SIZES = (2, 3)

# of each tensor's largest reference magnitude: the combine sums in float32
TOLERANCE = 1e-6
STEPS = 3


def skewed_load(seed: int) -> np.ndarray:
    return zipf_popularity(EXPERTS, 1.5, seed)


def placements(name: str, size: int):
    """The ``placement=`` of each case: one for every layer, or one per layer."""
    if name == "replicas":
        return moe.rebalance(skewed_load(1), ranks=size, redundant=size)
    if name == "drained":
        return moe.rebalance(skewed_load(1), ranks=size, redundant=size, drain=(1,))
    return [moe.rebalance(skewed_load(layer), ranks=size, redundant=size) for layer in (2, 3)]


def next_token_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy in the logits' dtype (transformers'
    own loss casts float64 logits to float32 first)."""
    logits = model(input_ids=tokens).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tokens[:, 1:].reshape(-1))


def close(mine: torch.Tensor, reference: torch.Tensor, tolerance: float = TOLERANCE) -> bool:
    scale = max(reference.abs().max().item(), 1e-300)
    return (mine - reference).abs().max().item() <= tolerance * scale


def mismatches(comm, reference, model, per_layer, what, tolerance=TOLERANCE) -> list:
    """Names whose ``what`` ("grad" or "data") differs from the reference's:
    an expert parameter slot by slot against its logical expert's rows (an
    empty slot against zeros). ``per_layer``: each layer's placement (a bare
    experts module: one)."""
    expected = dict(reference.named_parameters())
    wrong = []
    for name, parameter in model.named_parameters():
        wanted, mine = getattr(expected[name], what), getattr(parameter, what)
        if getattr(parameter, EXPERT_PARALLEL, False):
            layer = int(name.split(".")[2]) if len(per_layer) > 1 else 0
            held = torch.tensor(per_layer[layer].slots[comm.rank])
            wanted = torch.where((held >= 0).reshape((-1,) + (1,) * (wanted.ndim - 1)),
                                 wanted[held.clamp(min=0)], 0)
        if mine is None or not close(mine, wanted, tolerance):
            wrong.append(name)
    return wrong


def unequal_replicas(comm, model, per_layer) -> list:
    """Names of expert parameters where two replicas of one logical expert
    (on any ranks) differ in a bit."""
    wrong = []
    for name, parameter in model.named_parameters():
        if getattr(parameter, EXPERT_PARALLEL, False):
            every = comm.allgather(parameter.detach().contiguous())  # [all slots, ...]
            slots = per_layer[int(name.split(".")[2])].logical_to_physical
            if not all(torch.equal(every[s], every[replicas[0]])
                       for replicas in slots for s in replicas):
                wrong.append(name)
    return wrong


@pytest.mark.parametrize("case", ["replicas", "drained", "per-layer"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sgd_steps_keep_every_replica_equal_to_the_unsharded_expert(comm, family, case):
    placement = placements(case, comm.size)
    per_layer = placement if isinstance(placement, list) else [placement] * 2
    assert all((p.replica_counts > 1).any() for p in per_layer)
    reference = causal_lm(family, dtype=torch.float64)
    model = expert_parallel(copy.deepcopy(reference), comm, placement=placement)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                  for m in (reference, model)]
    gen = torch.Generator().manual_seed(1)
    report = []
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS_PER_RANK * comm.size, SEQ), generator=gen)
        mine = tokens[comm.rank * ROWS_PER_RANK:(comm.rank + 1) * ROWS_PER_RANK]
        for optimizer in optimizers:
            optimizer.zero_grad()
        reference_loss = next_token_loss(reference, tokens)
        reference_loss.backward()
        loss = next_token_loss(model, mine) / comm.size
        loss.backward()
        allreduce_gradients(model, comm)
        total = comm.allreduce(np.array([loss.item()]))[0]
        if abs(total - reference_loss.item()) > TOLERANCE * abs(reference_loss.item()):
            report.append((step, "loss", total, reference_loss.item()))
        report += [(step, "grad", name)
                   for name in mismatches(comm, reference, model, per_layer, "grad")]
        for optimizer in optimizers:
            optimizer.step()
        report += [(step, "weight", name)
                   for name in mismatches(comm, reference, model, per_layer, "data")]
        report += [(step, "replicas differ", name)
                   for name in unequal_replicas(comm, model, per_layer)]
    assert all_ranks(not report), report


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_other_experts_classes_under_a_placement(comm, feature):
    """The experts classes whose flags the two families do not use
    (transposed weights with biases, no gate, a post-expert norm; float32):
    outputs, input gradients and each slot's gradients (replicas summed,
    biases too) against the unsharded module on every rank's tokens."""
    if feature == "post-expert-norm" and MuseSparkExperts is None:
        pytest.skip(f"transformers {transformers.__version__} has no post-expert norm")
    reference = FEATURES[feature]()
    placement = placements("drained", comm.size)
    module = expert_parallel(copy.deepcopy(reference), comm, placement=placement)
    tokens, width = 6, reference.down_proj.shape[2 if reference.is_transposed else 1]
    gen = torch.Generator().manual_seed(2)
    count = tokens * comm.size
    x = torch.randn(count, width, generator=gen, requires_grad=True)
    index = torch.rand(count, EXPERTS, generator=gen).topk(2).indices
    weights = torch.rand(count, 2, generator=gen)
    probe = torch.randn(count, width, generator=gen)
    (reference(x, index, weights) * probe).sum().backward()
    rows = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    x_mine = x.detach()[rows].requires_grad_()
    out = module(x_mine, index[rows], weights[rows])
    (out * probe[rows]).sum().backward()
    allreduce_gradients(module, comm)
    expected = reference(x.detach(), index, weights)[rows]
    assert all_ranks(close(out, expected, 1e-5) and close(x_mine.grad, x.grad[rows], 1e-5)
                     and not mismatches(comm, reference, module, [placement], "grad", 1e-5))


def test_each_rank_holds_its_slots(comm):
    """A copy of logical expert e per slot holding e, zeros in empty slots,
    and the Dispatcher follows the placement."""
    placement = placements("drained", comm.size)
    reference = causal_lm("qwen3_moe", dtype=torch.float64)
    model = expert_parallel(copy.deepcopy(reference), comm, placement=placement)
    held = placement.slots[comm.rank]
    ok = True
    full = dict(reference.named_parameters())
    for index, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            mine = getattr(experts, name)
            wanted = full[f"model.layers.{index}.mlp.experts.{name}"]
            ok = ok and mine.shape[0] == placement.slots_per_rank and all(
                torch.equal(mine[j], wanted[e] if e >= 0 else torch.zeros_like(wanted[0]))
                for j, e in enumerate(held.tolist()))
        ok = ok and experts.commlib_dispatcher.core.placement == placement
    assert all_ranks(ok)


def refused_cases(comm):
    size = comm.size
    good = placements("replicas", size)
    return {
        "num_logical": moe.Placement.identity(2 * size, size),
        "world size": moe.Placement.identity(EXPERTS, size + 1),
        "2 experts modules": [good] * 3,
        "must be a commlib.moe.Placement": "identity",
        "different arguments": good if comm.rank == 0 else placements("drained", size),
    }


@pytest.mark.parametrize("reason", ["num_logical", "world size", "2 experts modules",
                                    "must be a commlib.moe.Placement", "different arguments"])
def test_a_bad_placement_is_refused_on_every_rank(comm, reason):
    model = causal_lm("qwen3_moe")
    shapes = [p.shape for p in model.parameters()]
    raises_everywhere(ValueError, lambda: expert_parallel(model, comm,
                                                     placement=refused_cases(comm)[reason]),
                      match=reason)
    assert all_ranks(shapes == [p.shape for p in model.parameters()])

