"""The sharded Gated DeltaNet and Mamba2 mixers (bindings.torch
gated_delta_rule, mamba2_scan) equal the mixer run one token at a time on
the whole sequence in one process (tests/recurrent_reference.py, float64):
outputs, the final state, and the gradient of every input, in the
contiguous, zigzag and zigzag_docs layouts, for a length the ranks do not
divide and for packed documents that cross rank boundaries."""

import pytest

import requires

torch = requires.module("torch")

from recurrent_reference import delta_rule_loop, ssd_loop  # noqa: E402

from commlib import CollectiveMismatchError  # noqa: E402
from commlib.bindings.torch import gated_delta_rule, mamba2_scan  # noqa: E402
from commlib.ring import shard_sequence, unshard_sequence  # noqa: E402

from conftest import all_ranks, raises_everywhere  # noqa: E402

# 1: the pieces alone, no neighbour; 2: zigzag's middle rank holds one piece;
# 3: a rank with neighbours on both sides, and 41 tokens neither 2 nor 3 divides;
# 4: two emulated hosts in the full tier, the states crossing a real link
WORLD_SIZES = (1, 2, 3, 4)

EVEN = 48  # cut evenly by 2, 4, 6 and 8 chunks: no cu_seqlens needed
LENGTH = 41
DOCUMENTS = [0, 13, 30, 41]  # three documents, crossing rank boundaries
CASES = [("contiguous", None), ("zigzag", None),
         ("contiguous", [0, LENGTH]), ("zigzag", [0, LENGTH]), ("zigzag_docs", [0, LENGTH]),
         ("contiguous", DOCUMENTS), ("zigzag", DOCUMENTS), ("zigzag_docs", DOCUMENTS)]
CHUNK = 8  # pieces of several chunks, the last one partial


def _random(seed, *shapes):
    """The same tensors on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]


def _check_sharded(comm, layout, cu_seqlens, inputs, state, reference, sharded):
    """``sharded(shards, state)`` against ``reference(inputs, state)`` on the
    whole sequence (each returns (out, final state)): outputs, final state
    and every gradient of a random projection of both."""
    length = inputs[0].shape[1]
    resets = () if cu_seqlens is None else tuple(cu_seqlens[1:-1])
    shard = lambda x: shard_sequence(x, comm, layout=layout, axis=1, cu_seqlens=cu_seqlens)  # noqa: E731
    leaves = [x.clone().requires_grad_() for x in inputs + [state]]
    want, want_final = reference(leaves[:-1], leaves[-1], resets)
    project, project_final = _random(7, want.shape, want_final.shape)
    want_grads = torch.autograd.grad((want * project).sum() + (want_final * project_final).sum(),
                                     leaves)
    shards = [shard(x).requires_grad_() for x in inputs]
    local_state = state.clone().requires_grad_()
    out, final = sharded(shards, local_state)
    # every rank uses the final state, so that its collective backward runs everywhere
    loss = (out * shard(project)).sum() + (final * project_final).sum() * (comm.rank == 0)
    grads = torch.autograd.grad(loss, shards + [local_state])
    whole = unshard_sequence(out.detach(), comm, layout=layout, axis=1, cu_seqlens=cu_seqlens,
                             length=length)
    errors = [float((whole - want).abs().max()), float((final.detach() - want_final).abs().max())]
    errors += [float((got - shard(w)).abs().max()) for got, w in zip(grads[:-1], want_grads)]
    state_grad = comm.allreduce(grads[-1].contiguous())
    errors.append(float((state_grad - want_grads[-1]).abs().max()))
    assert all_ranks(max(errors) < 1e-10), errors


@pytest.mark.parametrize("layout,cu_seqlens", CASES)
def test_gated_delta_rule_equals_one_process(comm, layout, cu_seqlens):
    length = EVEN if cu_seqlens is None else LENGTH
    q, k, v, g, b, state = _random(0, (1, length, 1, 8), (1, length, 1, 8), (1, length, 2, 8),
                                   (1, length, 2), (1, length, 2), (1, 2, 8, 8))
    g, b = -torch.nn.functional.softplus(g), torch.sigmoid(b)

    def reference(inputs, initial, resets):
        return delta_rule_loop(*inputs, initial, resets=resets, l2norm=True)

    def sharded(shards, initial):
        return gated_delta_rule(*shards, comm, layout=layout, chunk_size=CHUNK,
                                cu_seqlens=cu_seqlens, initial_state=initial,
                                output_final_state=True, use_qk_l2norm_in_kernel=True)

    _check_sharded(comm, layout, cu_seqlens, [q, k, v, g, b], state, reference, sharded)


@pytest.mark.parametrize("layout,cu_seqlens", CASES)
def test_mamba2_scan_equals_one_process(comm, layout, cu_seqlens):
    length = EVEN if cu_seqlens is None else LENGTH
    x, dt, B, C, A, D, dt_bias, state = _random(1, (1, length, 2, 4), (1, length, 2),
                                                (1, length, 1, 8), (1, length, 1, 8), (2,), (2,),
                                                (2,), (1, 2, 4, 8))
    A = -A.abs()

    def reference(inputs, initial, resets):
        x, dt, B, C = inputs
        return ssd_loop(x, dt, A, B, C, D, dt_bias, initial, resets=resets)

    def sharded(shards, initial):
        x, dt, B, C = shards
        return mamba2_scan(x, dt, A, B, C, comm, layout=layout, chunk_size=CHUNK, D=D,
                           dt_bias=dt_bias, initial_states=initial, dt_softplus=True,
                           return_final_states=True, cu_seqlens=cu_seqlens)

    _check_sharded(comm, layout, cu_seqlens, [x, dt, B, C], state, reference, sharded)


def test_without_initial_or_final_state(comm):
    """From a zero state, no final state asked: the sequence's start is a reset."""
    q, k, v, g, b = _random(2, *[(1, LENGTH, 2, 8)] * 3, (1, LENGTH, 2), (1, LENGTH, 2))
    g, b = -torch.nn.functional.softplus(g), torch.sigmoid(b)
    cu_seqlens = [0, LENGTH]
    shard = lambda x: shard_sequence(x, comm, layout="zigzag", axis=1, cu_seqlens=cu_seqlens)  # noqa: E731
    out, final = gated_delta_rule(*map(shard, (q, k, v, g, b)), comm, layout="zigzag",
                                  chunk_size=CHUNK, cu_seqlens=cu_seqlens)
    want, _ = delta_rule_loop(q, k, v, g, b, torch.zeros(1, 2, 8, 8))
    whole = unshard_sequence(out, comm, layout="zigzag", axis=1, cu_seqlens=cu_seqlens)
    assert all_ranks(final is None and float((whole - want).abs().max()) < 1e-10)


def _delta_shards(comm, heads=2):
    q, k, v, g, b = _random(3, *[(1, EVEN, heads, 8)] * 3, (1, EVEN, heads), (1, EVEN, heads))
    return [shard_sequence(x, comm, layout="contiguous", axis=1)
            for x in (q, k, v, -torch.nn.functional.softplus(g), torch.sigmoid(b))]


def test_a_layout_the_mixers_cannot_read_raises_everywhere(comm):
    shards = _delta_shards(comm)
    raises_everywhere(CollectiveMismatchError,
                      lambda: gated_delta_rule(*shards, comm, layout="balanced"),
                      match="recurrent mixers read")


def test_a_mismatched_shape_on_one_rank_raises_everywhere(comm):
    q, k, v, g, b = _delta_shards(comm)
    if comm.rank == comm.size - 1:
        b = b[..., :1]
    raises_everywhere(CollectiveMismatchError,
                      lambda: gated_delta_rule(q, k, v, g, b, comm, layout="contiguous"))


def test_a_state_of_another_shape_on_one_rank_raises_everywhere(comm):
    x, dt, B, C, A, state = _random(4, (1, EVEN, 2, 4), (1, EVEN, 2), (1, EVEN, 1, 8),
                                    (1, EVEN, 1, 8), (2,), (1, 2, 4, 8))
    if comm.rank == 0:
        state = state[..., :4]
    shard = lambda t: shard_sequence(t, comm, layout="zigzag", axis=1)  # noqa: E731
    raises_everywhere(CollectiveMismatchError,
                      lambda: mamba2_scan(shard(x), shard(dt), -A.abs(), shard(B), shard(C), comm,
                                          layout="zigzag", initial_states=state))
