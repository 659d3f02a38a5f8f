"""The mask decomposition against the mask written from its definition:
painting every block of every step gives exactly the visible pairs of the
packed, padded, windowed sequence (each once), for every layout and world
size; and the layouts' shards put back give the original tokens."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from commlib.sequence import documents, visibility
from commlib.sequence.documents import PADDING, as_offsets, needed_length, packing_for
from commlib.sequence.visibility import blocks, bounds

from attention_reference import document_mask


def _painted(packing, lo, hi, rows_of, keys_of):
    """The global [L, L] count of how many blocks claim each pair."""
    length = packing.length
    count = np.zeros((length, length), np.int64)
    for rank in range(packing.size):
        q_index = documents.local_index(packing, rank)
        for source in keys_of(rank):
            if source is None:  # the all-gather, put in sequence order
                order, k_spans = packing.in_order()
                k_index = np.concatenate([documents.local_index(packing, r)
                                          for r in range(packing.size)])[order]
            else:
                k_spans, k_index = packing.spans(source), documents.local_index(packing, source)
            for block in blocks(rows_of(rank), k_spans, lo, hi):
                mask = (np.ones((block.rows[1] - block.rows[0], block.cols[1] - block.cols[0]),
                                bool) if block.kind == "full" else
                        np.tri(block.rows[1] - block.rows[0], dtype=bool)
                        if block.kind == "causal" else block.mask)
                assert block.pairs == mask.sum()
                qi, ki = np.nonzero(mask)
                qg, kg = q_index[block.rows[0] + qi], k_index[block.cols[0] + ki]
                assert (qg >= 0).all() and (kg >= 0).all(), "a padding token was attended"
                np.add.at(count, (qg, kg), 1)
    return count


documents_strategy = st.lists(st.integers(1, 40), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(lengths=documents_strategy, size=st.integers(1, 4),
       layout=st.sampled_from(documents.LAYOUTS), causal=st.booleans(),
       window=st.sampled_from([None, (0, 0), (3, None), (7, 2), (None, 5), (-1, 1)]),
       method=st.sampled_from(["ring", "allgather"]), small_tiles=st.booleans())
def test_blocks_cover_exactly_the_visible_pairs(lengths, size, layout, causal, window, method,
                                                small_tiles):
    offsets = tuple(np.cumsum([0] + lengths).tolist())
    packing = packing_for(offsets, layout, size, needed_length(offsets, layout, size))
    lo, hi = bounds(causal, window)
    keys_of = (lambda rank: range(size)) if method == "ring" else (lambda rank: [None])
    with pytest.MonkeyPatch.context() as patch:
        if small_tiles:  # exercise band tiling and the gathering of short documents
            patch.setattr(visibility, "TILE", 4)
            patch.setattr(visibility, "GROUP", 8)
        visibility.blocks.cache_clear()
        count = _painted(packing, lo, hi, packing.spans, keys_of)
        visibility.blocks.cache_clear()
    assert np.array_equal(count, document_mask(offsets[-1], offsets, causal, window))


def test_the_plain_zigzag_ring_computes_what_it_did_before_packing():
    """One sequence, no window: the own block is one causal call, earlier
    ranks' blocks one call on their first half, later ranks' one call from
    our late chunk: the pre-packing schedule, no extra kernel calls."""
    packing = packing_for(None, "zigzag", 4, 16)
    lo, hi = bounds(True, None)
    own = blocks(packing.spans(2), packing.spans(2), lo, hi)
    assert [(b.rows, b.cols, b.kind) for b in own] == [((0, 16), (0, 16), "causal")]
    earlier = blocks(packing.spans(2), packing.spans(1), lo, hi)
    assert [(b.rows, b.cols, b.kind) for b in earlier] == [((0, 16), (0, 8), "full")]
    later = blocks(packing.spans(2), packing.spans(3), lo, hi)
    assert [(b.rows, b.cols, b.kind) for b in later] == [((8, 16), (0, 16), "full")]


def test_the_all_gather_costs_two_calls_per_query_chunk():
    packing = packing_for(None, "zigzag", 4, 1024)  # rank 1: chunks 1 and 6 of 512
    calls = blocks(packing.spans(1), packing.in_order()[1], *bounds(True, None))
    assert [(b.rows, b.cols, b.kind) for b in calls] == [
        ((0, 512), (0, 512), "full"), ((0, 512), (512, 1024), "causal"),
        ((512, 1024), (0, 3072), "full"), ((512, 1024), (3072, 3584), "causal")]


def test_short_documents_are_gathered_into_few_kernel_calls():
    offsets = tuple(range(0, 4097, 16))  # 256 documents of 16 tokens
    packing = packing_for(offsets, "contiguous", 1, 4096)
    calls = blocks(packing.spans(0), packing.spans(0), *bounds(True, None))
    assert len(calls) == 4096 // visibility.GROUP
    assert sum(b.pairs for b in calls) == 256 * 16 * 17 // 2


def test_a_window_skips_tiles_outside_its_band():
    packing = packing_for(None, "contiguous", 1, 8192)
    lo, hi = bounds(True, (1000, 0))
    calls = blocks(packing.spans(0), packing.spans(0), lo, hi)
    computed = sum((b.rows[1] - b.rows[0]) * (b.cols[1] - b.cols[0]) for b in calls)
    pairs = sum(b.pairs for b in calls)
    assert pairs == document_mask(8192, None, True, (1000, 0)).sum()
    assert computed < 1.6 * pairs  # the causal triangle would be 4.2x the band


@pytest.mark.parametrize("bad, why", [
    ([0, 5, 5, 9], "increase strictly"), ([1, 9], "start at 0"), ([0, 4, 8], "ends at 8"),
    ([[0, 9]], "1-D"), ([0.0, 9.0], "integer"), ([0], "at least two")])
def test_bad_cu_seqlens_say_what_is_wrong(bad, why):
    with pytest.raises(ValueError, match=why):
        as_offsets(bad, 9)


@pytest.mark.parametrize("window", [(1, 2, 3), "wide", (-2, 0), (1.5, 0), (True, 0)])
def test_bad_windows_say_what_is_wrong(window):
    with pytest.raises(ValueError, match="window"):
        bounds(True, window)


def test_zigzag_docs_gives_every_rank_equal_causal_work_whatever_the_documents():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.pareto(1.2, 64) * 400 + 16, 16384).astype(int)
    offsets = tuple(np.cumsum([0, *lengths]).tolist())

    def spread(layout, size=4):
        packing = packing_for(offsets, layout, size, needed_length(offsets, layout, size))
        lo, hi = bounds(True, None)
        work = [sum(b.pairs for source in range(size)
                    for b in blocks(packing.spans(r), packing.spans(source), lo, hi))
                for r in range(size)]
        return max(work) / np.mean(work)
    assert spread("zigzag_docs") < 1.02 < spread("zigzag")


def test_position_ids_that_restart_give_cu_seqlens():
    assert documents.cu_seqlens_from_position_ids([0, 1, 2, 0, 1, 0]).tolist() == [0, 3, 5, 6]
    assert documents.cu_seqlens_from_position_ids([[0, 1, 0], [0, 1, 0]]).tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="start at 0"):
        documents.cu_seqlens_from_position_ids([1, 2, 0])
    with pytest.raises(ValueError, match="packed alike"):
        documents.cu_seqlens_from_position_ids([[0, 1, 0], [0, 0, 1]])


def test_padding_spans_are_never_a_document():
    packing = packing_for([0, 10], "zigzag", 3, 4)  # 12 tokens: two of padding
    spans = [packing.spans(r) for r in range(3)]
    assert sum(s.length for r in spans for s in r if s.doc != PADDING) == 10
    assert all(sum(s.length for s in r) == 4 for r in spans)
    with pytest.raises(ValueError, match="at least 4 tokens"):
        packing_for([0, 10], "zigzag", 3, 2)
