"""The JAX sharded Gated DeltaNet and Mamba2 mixers (bindings.jax
gated_delta_rule, mamba2_scan) inside ``jax.jit`` equal the mixer run one
token at a time on the whole sequence in one process (torch, float64,
tests/recurrent_reference.py): outputs, the final state, and ``jax.grad`` of
every input, in the contiguous, zigzag and zigzag_docs layouts, for a length
the ranks do not divide and for packed documents that cross rank
boundaries, in float64 (x64) and float32; a step compiles once for ten
calls; bad input raises on every rank when JAX traces."""

import numpy as np
import pytest

import requires

torch = requires.module("torch")
jax = requires.module("jax")
jnp = jax.numpy
cj = requires.module("commlib.bindings.jax")

from recurrent_reference import delta_rule_loop, ssd_loop  # noqa: E402

from commlib import CollectiveMismatchError, recurrent  # noqa: E402
from commlib.bindings.jax._recurrent_state import halo  # noqa: E402
from commlib.ring import shard_sequence, unshard_sequence  # noqa: E402

from conftest import all_ranks, raises_everywhere  # noqa: E402

# 2: zigzag's middle rank holds one piece, and 41 tokens 2 does not divide.
# A rank with neighbours on both sides (3 ranks) runs the same pieces and scan
# (commlib/recurrent, mixer_pieces.py) in the torch mixers' test at 1 to 4
# ranks; each JAX case compiles for seconds (158 s at 3 ranks), so not here
WORLD_SIZES = (2,)

EVEN = 36  # cut evenly by 2, 4 and 6 chunks: no cu_seqlens needed
LENGTH = 41
DOCUMENTS = [0, 13, 30, 41]  # three documents, crossing rank boundaries
CHUNK = 8  # pieces of several chunks, the last one partial
# each case compiles its own program (about a second): every layout, the even
# cut without cu_seqlens, 41 tokens in padded shards, documents in each layout
CASES = [("contiguous", None), ("zigzag", [0, LENGTH]), ("zigzag", DOCUMENTS),
         ("zigzag_docs", DOCUMENTS)]
FLOAT32_CASES = [("contiguous", DOCUMENTS)]
# float64 within 1e-10 of the float64 loop; float32 (inputs as rounded) within
# 1e-5 of the largest reference value (measured below 6e-7 at 1-3 ranks)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}


def _random(seed, *shapes):
    """The same arrays on every rank, float64."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in shapes]


def _softplus(x):
    return np.logaddexp(x, 0.0)


def _delta_problem():
    """(sequence inputs, replicated inputs, initial state, reference, mixer)."""
    q, k, v, g, b, state = _random(0, (1, LENGTH, 1, 8), (1, LENGTH, 1, 8), (1, LENGTH, 2, 8),
                                   (1, LENGTH, 2), (1, LENGTH, 2), (1, 2, 8, 8))
    g, b = -_softplus(g), 1 / (1 + np.exp(-b))  # decays in (0, 1), betas in (0, 1)

    def reference(sequence, _, initial, resets):
        return delta_rule_loop(*sequence, initial, resets=resets, l2norm=True)

    def mixer(comm, layout, cu_seqlens, sequence, _, initial):
        return cj.gated_delta_rule(*sequence, comm, layout=layout, chunk_size=CHUNK,
                                   cu_seqlens=cu_seqlens, initial_state=initial,
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    return [q, k, v, g, b], [], state, reference, mixer


def _mamba2_problem():
    x, dt, B, C, A, D, dt_bias, state = _random(1, (1, LENGTH, 2, 4), (1, LENGTH, 2),
                                                (1, LENGTH, 1, 8), (1, LENGTH, 1, 8), (2,), (2,),
                                                (2,), (1, 2, 4, 8))

    def reference(sequence, replicated, initial, resets):
        x, dt, B, C = sequence
        A, D, dt_bias = replicated
        return ssd_loop(x, dt, -A.abs(), B, C, D, dt_bias, initial, resets=resets)

    def mixer(comm, layout, cu_seqlens, sequence, replicated, initial):
        x, dt, B, C = sequence
        A, D, dt_bias = replicated
        return cj.mamba2_scan(x, dt, -jnp.abs(A), B, C, comm, layout=layout, chunk_size=CHUNK,
                              D=D, dt_bias=dt_bias, initial_states=initial, dt_softplus=True,
                              return_final_states=True, cu_seqlens=cu_seqlens)
    return [x, dt, B, C], [A, D, dt_bias], state, reference, mixer


PROBLEMS = {"gated_delta_rule": _delta_problem, "mamba2_scan": _mamba2_problem}


def _reference(reference, sequence, replicated, state, resets):
    """The loop on the whole sequence in float64 torch: (out, final state,
    gradients of a random projection of both for sequence + replicated +
    [state], the projections)."""
    leaves = [torch.tensor(x, requires_grad=True) for x in sequence + replicated + [state]]
    count = len(sequence)
    out, final = reference(leaves[:count], leaves[count:-1], leaves[-1], resets)
    projections = _random(7, out.shape, final.shape)
    project, project_final = (torch.tensor(p) for p in projections)
    grads = torch.autograd.grad((out * project).sum() + (final * project_final).sum(), leaves)
    return out.detach().numpy(), final.detach().numpy(), [g.numpy() for g in grads], projections


def _sharded_step(comm, layout, cu_seqlens, mixer, count):
    """The jitted loss and gradient of every input (sequence shards, then
    replicated, then the initial state); the loss's projections are inputs
    too. Every rank uses the final state (weight 0 but on rank 0), so that
    its collective backward runs everywhere."""
    def loss(inputs, initial, project, project_final):
        out, final = mixer(comm, layout, cu_seqlens, inputs[:count], inputs[count:], initial)
        value = (out * project).sum() + (final * project_final).sum() * (comm.rank == 0)
        return value, (out, final)
    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def _errors(comm, layout, cu_seqlens, dtype, problem):
    """Max abs errors (relative to each reference's largest value for
    float32) of the jitted sharded mixer against the float64 loop: out,
    final, then every input's gradient."""
    length = EVEN if cu_seqlens is None else LENGTH
    sequence, replicated, state, reference, mixer = PROBLEMS[problem]()
    sequence = [x[:, :length] for x in sequence]
    # the reference reads the inputs as the sharded mixer does, rounded to dtype
    rounded = lambda x: np.asarray(x, dtype).astype(np.float64)  # noqa: E731
    sequence, replicated, state = [rounded(x) for x in sequence], \
        [rounded(x) for x in replicated], rounded(state)
    resets = () if cu_seqlens is None else tuple(cu_seqlens[1:-1])
    want, want_final, want_grads, projections = _reference(reference, sequence, replicated,
                                                           state, resets)
    shard = lambda x: shard_sequence(x, comm, layout=layout, axis=1, cu_seqlens=cu_seqlens)  # noqa: E731
    as_jax = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    step = _sharded_step(comm, layout, cu_seqlens, mixer, len(sequence))
    (grads, state_grad), (out, final) = step(
        [as_jax(shard(x)) for x in sequence] + [as_jax(x) for x in replicated], as_jax(state),
        as_jax(shard(projections[0])), as_jax(projections[1]))
    whole = unshard_sequence(np.asarray(out, np.float64), comm, layout=layout, axis=1,
                             cu_seqlens=cu_seqlens, length=length)
    found = [(whole, want), (np.asarray(final), want_final)]
    found += [(np.asarray(got), shard(w)) for got, w in zip(grads[:len(sequence)], want_grads)]
    summed = [comm.allreduce(np.ascontiguousarray(got, np.float64))  # replicated: every rank's part
              for got in list(grads[len(sequence):]) + [state_grad]]
    found += list(zip(summed, want_grads[len(sequence):]))
    dtypes_kept = all(np.asarray(got).dtype == dtype for got in [out, final] + list(grads))
    scale = (lambda w: 1.0) if dtype == "float64" else (lambda w: float(np.abs(w).max()) or 1.0)
    return dtypes_kept, [float(np.abs(np.asarray(got, np.float64) - w).max()) / scale(w)
                         for got, w in found]


@pytest.mark.quick_sample(2)
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("layout,cu_seqlens", CASES)
def test_jit_and_grad_equal_one_process_in_float64(comm, problem, layout, cu_seqlens):
    with jax.enable_x64(True):
        kept, errors = _errors(comm, layout, cu_seqlens, "float64", problem)
    assert all_ranks(kept and max(errors) < TOLERANCE["float64"]), errors


@pytest.mark.quick_sample(1)  # Mamba2 in the quick tier: float64, in zigzag_docs
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("layout,cu_seqlens", FLOAT32_CASES)
def test_jit_and_grad_equal_one_process_in_float32(comm, problem, layout, cu_seqlens):
    kept, errors = _errors(comm, layout, cu_seqlens, "float32", problem)
    assert all_ranks(kept and max(errors) < TOLERANCE["float32"]), errors


def test_ten_calls_trace_once(comm):
    """The same shapes and settings: one trace, one compiled program, for
    new values each call; from a zero state without a final state (the
    sequence's start is a reset), each call's output equals the loop's."""
    traces = []
    whole = _random(2, *[(1, EVEN, 2, 8)] * 3, (1, EVEN, 2), (1, EVEN, 2))
    whole[3], whole[4] = -_softplus(whole[3]), 1 / (1 + np.exp(-whole[4]))
    shard = lambda x: shard_sequence(x, comm, layout="zigzag", axis=1)  # noqa: E731
    q, k, v, g, b = (jnp.asarray(shard(x), "float32") for x in whole)

    @jax.jit
    def step(q, k, v, g, b):
        traces.append(1)
        mixed = lambda q: cj.gated_delta_rule(q, k, v, g, b, comm, layout="zigzag",  # noqa: E731
                                              chunk_size=CHUNK)
        return mixed(q)[0], jax.grad(lambda q: mixed(q)[0].sum())(q)
    errors = []
    for i in range(10):
        out, grad = step(q * (1 + i), k, v, g, b)
        inputs = [torch.tensor(np.asarray(x, np.float64)) for x in whole]
        inputs[0] = inputs[0] * (1 + i)
        want = delta_rule_loop(*inputs, torch.zeros(1, 2, 8, 8))[0].numpy()
        errors.append(float(np.abs(np.asarray(out, np.float64) - shard(want)).max()))
        errors[-1] += float(not np.isfinite(np.asarray(grad)).all())
    assert all_ranks(len(traces) == 1 and step._cache_size() == 1 and max(errors) < 1e-4), \
        (len(traces), errors)


def test_halo_under_jit_is_the_cores_and_differentiates_by_its_backward(comm):
    """The mixers use incoming_state; halo (for the convolutions before them)
    is wrapped alike: inside jit it equals the core's eager halo on NumPy,
    and its gradient the core's halo_backward, documents across ranks."""
    where = dict(layout="zigzag_docs", cu_seqlens=DOCUMENTS)
    x = shard_sequence(_random(6, (1, LENGTH, 3))[0], comm, axis=1, **where)
    want = recurrent.halo(x, 3, comm, **where)
    probe = _random(8, want.shape)[0]
    want_grad = recurrent.halo_backward(probe, x.shape, 3, comm, **where)
    with jax.enable_x64(True):
        got, grad = jax.jit(jax.value_and_grad(
            lambda x: (halo(x, 3, comm, **where) * probe).sum()))(jnp.asarray(x))
        found = jax.jit(lambda x: halo(x, 3, comm, **where))(jnp.asarray(x))
    assert all_ranks(np.array_equal(np.asarray(found), want)
                     and np.allclose(float(got), (want * probe).sum(), rtol=1e-12)
                     and np.array_equal(np.asarray(grad), want_grad))


def _mamba2_shards(comm):
    x, dt, B, C = _random(4, (1, EVEN, 2, 4), (1, EVEN, 2), (1, EVEN, 1, 8), (1, EVEN, 1, 8))
    return [jnp.asarray(shard_sequence(t, comm, layout="zigzag", axis=1)) for t in (x, dt, B, C)]


def test_a_layout_the_mixers_cannot_read_raises_everywhere(comm):
    x, dt, B, C = _mamba2_shards(comm)
    A = -jnp.ones(2)
    raises_everywhere(CollectiveMismatchError,
                      lambda: jax.jit(lambda x: cj.mamba2_scan(x, dt, A, B, C, comm,
                                                               layout="balanced"))(x),
                      match="recurrent mixers read")


def test_a_state_of_another_shape_on_one_rank_raises_everywhere(comm):
    x, dt, B, C = _mamba2_shards(comm)
    state = jnp.zeros((1, 2, 4, 8 if comm.rank else 4))
    raises_everywhere(CollectiveMismatchError,
                      lambda: jax.jit(lambda x, s: cj.mamba2_scan(
                          x, dt, -jnp.ones(2), B, C, comm, layout="zigzag",
                          initial_states=s))(x, state), match="initial_states")


def test_a_mismatched_gate_on_one_rank_raises_everywhere(comm):
    q, k, v, g, b = (jnp.asarray(shard_sequence(x, comm, layout="contiguous", axis=1))
                     for x in _random(5, *[(1, EVEN, 2, 8)] * 3, (1, EVEN, 2), (1, EVEN, 2)))
    if comm.rank == comm.size - 1:
        b = b[..., :1]
    raises_everywhere(CollectiveMismatchError,
                      lambda: jax.jit(lambda q: cj.gated_delta_rule(
                          q, k, v, g, b, comm, layout="contiguous")[0])(q))


def test_a_chunk_size_of_zero_on_one_rank_raises_everywhere(comm):
    x, dt, B, C = _mamba2_shards(comm)
    raises_everywhere(CollectiveMismatchError,
                      lambda: jax.jit(lambda x: cj.mamba2_scan(
                          x, dt, -jnp.ones(2), B, C, comm, layout="zigzag",
                          chunk_size=0 if comm.rank == 0 else CHUNK))(x), match="chunk_size")
