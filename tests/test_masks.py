"""commlib.sequence.masks, commlib.sequence.balanced and the sparse routes on one process:
each slice kind against its definition written out pair by pair, the
builders against the masks they stand for, the balanced solver's spread
of work, and the K/V rows the sparse exchange moves against the keys each
rank's queries see in the dense mask."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib.ring.sparse import routes
from commlib.sequence import balanced
from commlib.sequence.common_masks import block_diagonal, multimodal, prefix_lm, shared_prefix
from commlib.sequence.documents import PADDING
from commlib.sequence.masks import KINDS, Mask, Slice, covered, from_cu_seqlens, from_mask_mod

from attention_reference import document_mask


def _by_definition(part: Slice, length: int) -> np.ndarray:
    """The issue's rule for one slice, evaluated pair by pair."""
    (qs, qe), (ks, ke) = part.q, part.k
    lq, lk = qe - qs, ke - ks
    out = np.zeros((length, length), bool)
    for i in range(qs, qe):
        for j in range(ks, ke):
            a, b = i - qs, j - ks
            causal, inv_causal = b <= a + lk - lq, b >= a
            out[i, j] = {"full": True, "causal": causal, "inv_causal": inv_causal,
                         "bicausal": causal and inv_causal}[part.kind]
    return out


@st.composite
def _slices(draw):
    length = draw(st.integers(2, 24))
    qs = draw(st.integers(0, length - 1))
    qe = draw(st.integers(qs + 1, length))
    ks = draw(st.integers(0, length - 1))
    ke = draw(st.integers(ks + 1, length))
    return Slice((qs, qe), (ks, ke), draw(st.sampled_from(KINDS))), length


@settings(max_examples=200, deadline=None)
@given(_slices())
def test_every_kind_is_its_definition(drawn):
    part, length = drawn
    mask = Mask([part], length=length)
    want = _by_definition(part, length)
    assert np.array_equal(mask.dense(), want)
    assert np.array_equal(mask.row_counts(), want.sum(axis=1))
    assert mask.pairs_in((part.q[0], part.q[1])) == want.sum()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=8),
       st.lists(st.tuples(st.integers(0, 50), st.integers(1, 12)), min_size=1, max_size=6))
def test_key_ranges_and_their_coverage_are_the_keys_seen(bands, rows):
    """Keys seen as merged ranges, and positions they cover below a point,
    against the same keys painted one by one."""
    length = 64
    parts = [Slice((q, q + 1), (k, min(k + n, length))) for q, (k, n) in
             zip(range(0, length, 2), bands)]
    mask = Mask(parts, length=length)
    runs = sorted({(a, min(a + n, length)) for a, n in rows if a < length})
    painted = mask.dense()[np.concatenate([np.arange(a, b) for a, b in runs])].any(axis=0)
    starts, stops = mask.key_ranges(runs)
    assert np.all(starts[1:] >= stops[:-1]) and np.all(stops > starts)
    assert np.array_equal(mask.keys_seen(runs), painted)
    points = np.arange(length + 1)
    assert np.array_equal(covered(starts, stops, points), np.r_[0, np.cumsum(painted)])


def test_causal_is_bottom_right_and_inv_causal_top_left():
    """A 2 x 4 causal slice: the last query sees the last key (flash-attn);
    inv_causal: the first query sees the first key onwards."""
    causal = Mask([Slice((0, 2), (0, 4), "causal")]).dense()[:2]
    assert causal.tolist() == [[True, True, True, False], [True, True, True, True]]
    inv = Mask([Slice((0, 2), (0, 4), "inv_causal")]).dense()[:2]
    assert inv.tolist() == [[True, True, True, True], [False, True, True, True]]


@pytest.mark.parametrize("offsets", [[0, 40], [0, 13, 40, 61], [0, 1, 2, 30]])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, (6, 0), (3, 5)])
def test_from_cu_seqlens_is_the_document_mask(offsets, causal, window):
    if causal and window is not None and window[1]:
        window = (window[0], 0)
    mask = from_cu_seqlens(offsets, causal=causal, window=window)
    assert np.array_equal(mask.dense(), document_mask(offsets[-1], offsets, causal, window))
    assert len(mask.slices) <= 3 * (len(offsets) - 1)


MODS = {
    "causal": lambda b, h, q, k: q >= k,
    "window": lambda b, h, q, k: (q >= k) & (q - k < 9),
    "document": lambda b, h, q, k: (q // 23 == k // 23) & (q >= k),
    "checkerboard": lambda b, h, q, k: (q + k) % 3 == 0,   # no kind describes it
}


@pytest.mark.parametrize("block", [7, 16, 128])
@pytest.mark.parametrize("name", MODS)
def test_from_mask_mod_is_exact(name, block):
    length = 70
    index = np.arange(length)
    want = np.asarray(MODS[name](0, 0, index[:, None], index[None, :]), bool)
    mask = from_mask_mod(MODS[name], length, block=block)
    assert np.array_equal(mask.dense(), want)
    if name == "causal":  # diagonal blocks are causal slices, the rest full
        assert {part.kind for part in mask.slices} <= {"full", "causal"}


@pytest.mark.parametrize("bad, message", [
    (lambda: Mask([Slice((0, 4), (0, 4)), Slice((2, 6), (3, 5))]), "overlap"),
    (lambda: Slice((3, 3), (0, 4)), "0 <= start < stop"),
    (lambda: Slice((0, 4), (0, 4), "diagonal"), "kind must be one of"),
    (lambda: Mask([Slice((0, 8), (0, 8))], length=4), "past the length"),
    (lambda: Mask([]), "at least one slice"),
    (lambda: from_cu_seqlens([0, 5, 5], causal=True), "increase strictly"),
])
def test_bad_masks_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


def _busiest_over_mean(mask, placement):
    work = balanced.loads(mask, placement)
    return float(work.max() / work.mean())


BALANCED_MASKS = {
    "shared-prefix": lambda n: shared_prefix(n, n // 4, 4),
    "multimodal": lambda n: multimodal(n, [(n // 8, n // 4), (n // 2, n // 2 + n // 6)]),
}


@pytest.mark.parametrize("size", [2, 3, 4, 8])
@pytest.mark.parametrize("name", BALANCED_MASKS)
def test_balanced_busiest_rank_is_within_ten_percent_of_the_mean(name, size):
    """The issue's bound for the shared-prefix and multimodal masks;
    zigzag (reported beside it in docs/masks.md) is the layout to beat."""
    mask = BALANCED_MASKS[name](8192)
    solved = balanced.solve(mask, size)
    zigzag = balanced.placement_for("zigzag", size, None, mask=mask)
    ratio, zigzag_ratio = _busiest_over_mean(mask, solved), _busiest_over_mean(mask, zigzag)
    assert ratio <= 1.10, (ratio, zigzag_ratio)
    assert ratio <= zigzag_ratio


@pytest.mark.parametrize("layout", ["balanced", "zigzag", "contiguous"])
@pytest.mark.parametrize("name", BALANCED_MASKS)
def test_loads_count_every_visible_pair_once(name, layout):
    mask = BALANCED_MASKS[name](1000)
    placement = balanced.placement_for(layout, 3, None, mask=mask)
    assert balanced.loads(mask, placement).sum() == mask.dense().sum()


def test_the_solver_places_every_chunk_once_the_same_way_every_time():
    mask = multimodal(10_000, [(1000, 3000)])
    solved = balanced.solve(mask, 3)
    again = balanced.solve.__wrapped__(mask, 3)
    assert solved == again
    chunks = sorted(c for held in solved.chunks for c in held)
    assert chunks == list(range(-(-mask.length // solved.chunk)))
    assert all(len(held) * solved.chunk <= solved.local_length for held in solved.chunks)


def _keys_seen_in_dense(mask, placement, rank):
    """Global keys that some query of ``rank`` sees, and those it holds."""
    dense = mask.dense()
    mine = [s for s in placement.spans(rank) if s.doc != PADDING]
    rows = np.concatenate([np.arange(s.origin, s.origin + s.length) for s in mine])
    return set(np.flatnonzero(dense[rows].any(axis=0)).tolist()), set(rows.tolist())


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "balanced"])
def test_sparse_receives_only_the_keys_its_queries_see(layout):
    """Block-diagonal, 8 documents over 4 ranks: each rank receives exactly
    the keys its queries see that it does not hold, never more than the
    ring's (P - 1) shards."""
    size, mask = 4, block_diagonal(4096, 8, causal=False)
    placement = balanced.placement_for(layout, size, None, mask=mask)
    plan = routes(mask, placement)
    ring = (size - 1) * plan.local_length
    for rank in range(size):
        seen, held = _keys_seen_in_dense(mask, placement, rank)
        assert plan.received(rank) == len(seen - held) <= ring
    if layout == "balanced":  # whole documents on each rank: nothing to receive
        assert plan.busiest_share() == 0.0


@pytest.mark.parametrize("name, mask", [("prefix-lm", prefix_lm(3000, 700)),
                                        ("multimodal", multimodal(3000, [(100, 900)])),
                                        ("causal", from_cu_seqlens([0, 3000], causal=True))])
@pytest.mark.parametrize("size", [2, 3])
def test_sparse_routes_match_the_dense_mask(name, mask, size):
    placement = balanced.placement_for("balanced", size, None, mask=mask)
    plan = routes(mask, placement)
    for rank in range(size):
        seen, held = _keys_seen_in_dense(mask, placement, rank)
        assert plan.received(rank) == len(seen - held)
