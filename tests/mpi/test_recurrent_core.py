"""commlib.recurrent: the pieces of a shard, the state entering each piece
and the tokens before it, forward and backward, in NumPy, torch and JAX
(float64), against the recurrence run token by token over the whole
sequence (states, halos) and torch autograd of the pieces' scan over every
rank's pieces gathered (gradients); bad input raises on every rank."""

import contextlib

import numpy as np
import pytest
from mpi4py import MPI

from commlib import CollectiveMismatchError, recurrent
from commlib.ring import shard_sequence
from commlib.sequence.masks import from_cu_seqlens

import arrayimpl
import requires
from conftest import all_ranks, raises_everywhere

# 1: zigzag's two chunks are one piece; 2: even; 3: odd, a middle rank whose
# zigzag chunks join, and 13 tokens leave whole chunks of padding
WORLD_SIZES = (1, 2, 3)

torch = requires.module("torch")
jax = requires.module("jax")
bindings = requires.module("commlib.bindings.torch._recurrent_state")

BATCH, HEADS, DK, DV, CHANNELS = 2, 2, 3, 2, 3
# (layout, cu_seqlens, balanced mask length): 12 tokens (no padding), 13
# (padding), documents of one token and documents crossing ranks; 29 tokens
# balanced in one-token chunks (pieces shorter than a halo)
SEQUENCES = {
    "contiguous-even": ("contiguous", None, None),
    "contiguous-uneven": ("contiguous", [0, 13], None),
    "contiguous-docs": ("contiguous", [0, 1, 5, 6, 13], None),
    "zigzag-even": ("zigzag", None, None),
    "zigzag-uneven": ("zigzag", [0, 13], None),
    "zigzag-docs": ("zigzag", [0, 1, 5, 6, 13], None),
    "zigzag_docs": ("zigzag_docs", [0, 1, 5, 6, 13], None),
    "balanced": ("balanced", None, 29),
}
CASES = [pytest.param(*value, id=name) for name, value in SEQUENCES.items()]
# JAX outside jit compiles each small op on first use (seconds a case here): one sequence,
# with documents, padding and both pieces of zigzag
JAX_SEQUENCES = ("zigzag-docs",)
IMPL_CASES = [pytest.param(impl.values[0], *case.values, id=f"{impl.id}-{case.id}")
              for impl in arrayimpl.params(arrayimpl.HOST) for case in CASES
              if impl.id != "jax" or case.id in JAX_SEQUENCES]
TOLERANCE = 1e-10  # float64 throughout (errors measured ~1e-15)


class Sharded:
    """A global sequence laid out over the ranks: its length, where the
    recurrence resets, and the global position of each token of this
    rank's shard (-1: padding), told by shard_sequence itself."""

    def __init__(self, comm, layout, cu_seqlens, mask_length):
        self.comm = comm
        mask = None if mask_length is None else from_cu_seqlens([0, mask_length], causal=True)
        self.where = dict(layout=layout, cu_seqlens=cu_seqlens, mask=mask)
        self.length = mask_length or (cu_seqlens[-1] if cu_seqlens else 12)
        # documents reset the state (a mask's documents are the mixer's business)
        self.starts = sorted(cu_seqlens[:-1]) if cu_seqlens else [0]
        numbered = np.arange(1, self.length + 1)[None]
        self.index = self.shard(numbered, axis=1)[0] - 1
        self.pieces = recurrent.pieces(comm, self.index.size, **self.where)

    def shard(self, x, axis):
        return shard_sequence(x, self.comm, axis=axis, **self.where)

    def origins(self):
        """Each of this rank's pieces' first global position (-1: padding)."""
        return [int(self.index[start]) for start, _ in self.pieces]

    def document_start(self, position):
        return max(s for s in self.starts if s <= position)


def everyones(value):
    """``value`` of every rank, in rank order (mpi4py, outside commlib)."""
    return MPI.COMM_WORLD.allgather(value)


@contextlib.contextmanager
def float64(impl):
    """JAX with 64-bit types (without them it has no float64 arrays)."""
    if impl.framework == "jax":
        with jax.enable_x64(True):
            yield
    else:
        yield


def close(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return got.shape == want.shape and bool(
        np.all(np.abs(got - want) <= TOLERANCE * np.maximum(1.0, np.abs(want))))


@pytest.mark.parametrize("layout, cu_seqlens, mask_length", CASES)
def test_pieces_are_the_shards_runs(comm, layout, cu_seqlens, mask_length):
    """Pieces tile the shard in order; each is padding or consecutive global
    positions, and no real piece continues the one before it."""
    seq = Sharded(comm, layout, cu_seqlens, mask_length)
    ok = [stop for _, stop in seq.pieces[:-1]] == [start for start, _ in seq.pieces[1:]]
    ok &= seq.pieces[0][0] == 0 and seq.pieces[-1][1] == seq.index.size
    last_end = None
    for start, stop in seq.pieces:
        run = seq.index[start:stop]
        padding = bool((run < 0).all())
        ok &= padding or bool((np.diff(run) == 1).all() and run[0] >= 0)
        ok &= padding or run[0] != last_end
        last_end = None if padding else run[-1] + 1
    assert all_ranks(ok), (seq.pieces, seq.index.tolist())


def token_maps(length, kind, gates, seed):
    """Per token t, the map s -> A_t s + U_t: A_t = alpha_t (I - beta_t k k^T)
    (matrix) or alpha_t (scalar); ``gates``: alpha near one, or mixed
    (uniform, near zero, exactly zero)."""
    rng = np.random.default_rng(seed)
    lead = (length, BATCH, HEADS)
    if gates == "near-one":
        alpha = 1 - 1e-4 * rng.random(lead)
    else:
        alpha = rng.choice([0.0, 1e-6, 0.5, 0.999], size=lead) * rng.uniform(0.5, 1, lead)
    update = rng.standard_normal(lead + (DK, DV))
    if kind == "scalar":
        return alpha, update
    k = rng.standard_normal(lead + (DK,))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.random(lead)[..., None, None]
    return alpha[..., None, None] * (np.eye(DK) - beta * k[..., :, None] * k[..., None, :]), \
        update


def apply(kind, transition, state):
    return transition @ state if kind == "matrix" else transition[..., None, None] * state


def compose(kind, seq, maps, positions):
    """A piece's (transition, offset) from zero, as a mixer makes it
    (resets at the documents it contains)."""
    transition_per_token, update = maps
    eye = np.broadcast_to(np.eye(DK), (BATCH, HEADS, DK, DK))
    transition = eye if kind == "matrix" else np.ones((BATCH, HEADS))
    offset = np.zeros((BATCH, HEADS, DK, DV))
    for t in positions:
        if t in seq.starts:
            transition, offset = transition * 0, offset * 0
        a = transition_per_token[t]
        transition = a @ transition if kind == "matrix" else a * transition
        offset = apply(kind, a, offset) + update[t]
    return transition, offset


def entering(seq, maps, kind):
    """The state entering every global position, token by token."""
    transition_per_token, update = maps
    state = np.zeros((BATCH, HEADS, DK, DV))
    found = []
    for t in range(seq.length):
        if t in seq.starts:
            state = state * 0
        found.append(state)
        state = apply(kind, transition_per_token[t], state) + update[t]
    return found


def piece_problem(seq, kind, gates):
    """This rank's stacked (transition, offset), padding pieces filled with
    noise nobody may read, and the expected incoming states."""
    maps = token_maps(seq.length, kind, gates, seed=7)
    states = entering(seq, maps, kind)
    noise = np.random.default_rng(100 + seq.comm.rank)
    transitions, offsets, expected = [], [], []
    for (start, stop), origin in zip(seq.pieces, seq.origins()):
        if origin < 0:
            t, o = token_maps(1, kind, gates, seed=noise.integers(1 << 30))
            transitions.append(t[0])
            offsets.append(o[0])
            expected.append(np.zeros((BATCH, HEADS, DK, DV)))
        else:
            t, o = compose(kind, seq, maps, range(origin, origin + stop - start))
            transitions.append(t)
            offsets.append(o)
            expected.append(states[origin])
    return np.stack(transitions), np.stack(offsets), np.stack(expected)


def scan_gradients(seq, kind, transition, offset, weights):
    """d(sum over ranks of <weights, incoming states>) / d(this rank's
    transition, offset): torch autograd of the sequential scan over every
    rank's real pieces, gathered and sorted by global position."""
    real = [i for i, origin in enumerate(seq.origins()) if origin >= 0]
    sent = [(seq.origins()[i], i, transition[i], offset[i], weights[i]) for i in real]
    gathered = [(rank,) + piece for rank, pieces in enumerate(everyones(sent))
                for piece in pieces]
    leaves = {}
    state, loss = None, torch.zeros((), dtype=torch.float64)
    for rank, origin, i, t, o, w in sorted(gathered, key=lambda piece: piece[1]):
        if origin in seq.starts:
            state = None
        if state is not None:
            loss = loss + (torch.from_numpy(w) * state).sum()
        t, o = leaves[rank, i] = tuple(torch.tensor(a, requires_grad=True) for a in (t, o))
        state = o if state is None else apply(kind, t, state) + o
    own = [a for i in real for a in leaves[seq.comm.rank, i]]
    grads = torch.autograd.grad(loss, own, allow_unused=True) if loss.requires_grad else \
        [None] * len(own)
    grad_t, grad_o = np.zeros_like(transition), np.zeros_like(offset)
    for n, i in enumerate(real):
        for out, grad in ((grad_t, grads[2 * n]), (grad_o, grads[2 * n + 1])):
            if grad is not None:
                out[i] = grad.numpy()
    return grad_t, grad_o


@pytest.mark.parametrize("impl, layout, cu_seqlens, mask_length", IMPL_CASES)
@pytest.mark.parametrize("kind", ["matrix", "scalar"])
@pytest.mark.parametrize("gates", ["near-one", "mixed"])
def test_incoming_state(comm, impl, layout, cu_seqlens, mask_length, kind, gates):
    """States against the token-by-token recurrence; gradients against
    autograd of the scan of every rank's pieces."""
    seq = Sharded(comm, layout, cu_seqlens, mask_length)
    transition, offset, expected = piece_problem(seq, kind, gates)
    weights = np.random.default_rng(comm.rank).standard_normal(offset.shape)
    want_t, want_o = scan_gradients(seq, kind, transition, offset, weights)
    with float64(impl):
        t, o, w = (impl.asarray(a) for a in (transition, offset, weights))
        got = recurrent.incoming_state(t, o, comm, **seq.where)
        grad_t, grad_o = recurrent.incoming_state_backward(w, t, o, comm, **seq.where)
        ok = impl.is_native(got) and impl.dtype_name(got) == "float64"
        ok &= close(impl.to_numpy(got), expected)
        ok &= close(impl.to_numpy(grad_t), want_t) and close(impl.to_numpy(grad_o), want_o)
    assert all_ranks(ok)


def halo_problem(seq, width, axis, seed=3):
    """The global x [B, L, C] (sequence along ``axis``: 1, or last as [B, C,
    L]), this rank's shard, its expected halos, halo gradients drawn per
    rank, and the expected gradient of the shard."""
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((BATCH, seq.length, CHANNELS))
    halos, grads = [], []
    grad_full = np.zeros_like(full)
    for rank, mine in enumerate(everyones(seq.origins())):
        draws = np.random.default_rng(seed + 1 + rank).standard_normal(
            (len(mine), BATCH, width, CHANNELS))
        for origin, drawn in zip(mine, draws):
            wanted = np.zeros((BATCH, width, CHANNELS))
            for j in range(width):
                g = origin - width + j
                if origin >= 0 and g >= seq.document_start(origin):
                    wanted[:, j] = full[:, g]
                    grad_full[:, g] += drawn[:, j]
            if rank == seq.comm.rank:
                halos.append(wanted)
        if rank == seq.comm.rank:
            grads = draws
    moved = (lambda a, at: a) if axis == 1 else (lambda a, at: np.moveaxis(a, at, -1))
    return (moved(seq.shard(full, axis=1), 1), moved(np.stack(halos), 2),
            moved(np.stack(grads), 2), moved(seq.shard(grad_full, axis=1), 1))


@pytest.mark.parametrize("impl, layout, cu_seqlens, mask_length", IMPL_CASES)
@pytest.mark.parametrize("width, axis", [(1, 1), (3, -1), (5, 1)])
def test_halo(comm, impl, layout, cu_seqlens, mask_length, width, axis):
    """Halos against slices of the global sequence (zeros before a document
    and for padding; a width beyond a piece walks back over several);
    gradients against every rank's halo gradients added at the tokens
    they read."""
    seq = Sharded(comm, layout, cu_seqlens, mask_length)
    x, expected, grad_halo, expected_grad = halo_problem(seq, width, axis)
    with float64(impl):
        got = recurrent.halo(impl.asarray(x), width, comm, axis=axis, **seq.where)
        grad_x = recurrent.halo_backward(impl.asarray(grad_halo), x.shape, width, comm,
                                         axis=axis, **seq.where)
        ok = impl.is_native(got) and impl.is_native(grad_x)
        ok &= close(impl.to_numpy(got), expected) and close(impl.to_numpy(grad_x), expected_grad)
    assert all_ranks(ok)


@pytest.mark.parametrize("layout, cu_seqlens, mask_length", [CASES[5], CASES[7]])
def test_torch_bindings(comm, layout, cu_seqlens, mask_length):
    """The autograd functions give the core's values and the references'
    gradients."""
    seq = Sharded(comm, layout, cu_seqlens, mask_length)
    transition, offset, expected = piece_problem(seq, "matrix", "mixed")
    weights = np.random.default_rng(comm.rank).standard_normal(offset.shape)
    want_t, want_o = scan_gradients(seq, "matrix", transition, offset, weights)
    t, o = (torch.tensor(a, requires_grad=True) for a in (transition, offset))
    state = bindings.incoming_state(t, o, comm, **seq.where)
    (state * torch.from_numpy(weights)).sum().backward()
    ok = close(state.detach(), expected) and close(t.grad, want_t) and close(o.grad, want_o)
    x, halos, grad_halo, expected_grad = halo_problem(seq, 3, 1)
    xt = torch.tensor(x, requires_grad=True)
    got = bindings.halo(xt, 3, comm, **seq.where)
    (got * torch.from_numpy(grad_halo)).sum().backward()
    ok &= close(got.detach(), halos) and close(xt.grad, expected_grad)
    assert all_ranks(ok)


def test_bad_input_raises_everywhere(comm):
    seq = Sharded(comm, "zigzag", [0, 13], None)
    transition, offset, _ = piece_problem(seq, "matrix", "mixed")
    where = seq.where
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state(
        transition, offset, comm, layout="diagonal"), match="unknown layout")
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state(
        transition[..., 0], offset, comm, **where), match="matrix per leading index")
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state(
        transition[:, :, :, :, :2], offset, comm, **where), match="has shape")
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state(
        np.concatenate([transition, transition[:1]]), np.concatenate([offset, offset[:1]]),
        comm, **where), match="stacked over this rank's pieces")
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state_backward(
        offset[..., :1], transition, offset, comm, **where), match="grad_state")
    x = np.zeros((1, len(seq.index), 2))
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.halo(
        x, 0, comm, **where), match="width must be a positive int")
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.halo(
        x[:, :-1], 2, comm, **where), match="shard_sequence")


def test_another_shape_on_one_rank_raises_everywhere(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    seq = Sharded(comm, "contiguous", None, None)
    transition, offset, _ = piece_problem(seq, "scalar", "mixed")
    if comm.rank == 1:  # a state of another shape, consistent on its own
        offset = np.concatenate([offset, offset], axis=-1)
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.incoming_state(
        transition, offset, comm, **seq.where), match="different arguments")
    x = np.zeros((1, len(seq.index), 2 + (comm.rank == 1)))
    raises_everywhere(CollectiveMismatchError, lambda: recurrent.halo(
        x, 2, comm, **seq.where), match="different arguments")
