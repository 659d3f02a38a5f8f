"""commlib.recurrent.pieces at world sizes no mpiexec here runs (up to 8):
every rank's pieces, read against the global positions shard_sequence's
placement gives each token, tile the sequence once, are padding or
consecutive positions, and are maximal; zigzag's middle rank has one."""

from types import SimpleNamespace

import numpy as np
import pytest

from commlib.recurrent import pieces
from commlib.sequence.balanced import placement_for
from commlib.sequence.documents import local_index
from commlib.sequence.masks import from_cu_seqlens

SIZES = (1, 2, 4, 5, 8)
# (layout, cu_seqlens, mask length): none divides every size's chunks
SEQUENCES = {
    "contiguous": ("contiguous", [0, 37], None),
    "zigzag": ("zigzag", [0, 37], None),
    "zigzag-docs": ("zigzag", [0, 1, 2, 20, 37], None),
    "zigzag_docs": ("zigzag_docs", [0, 1, 2, 20, 37], None),
    "balanced": ("balanced", None, 101),
}


def every_ranks_pieces(size, layout, cu_seqlens, mask_length):
    """[(global positions of the piece's tokens, -1 padding)] per rank."""
    mask = None if mask_length is None else from_cu_seqlens([0, mask_length], causal=True)
    placement = placement_for(layout, size, None, cu_seqlens=cu_seqlens, mask=mask)
    found = []
    for rank in range(size):
        index = local_index(placement, rank)
        comm = SimpleNamespace(size=size, rank=rank)
        held = pieces(comm, index.size, layout=layout, cu_seqlens=cu_seqlens, mask=mask)
        assert [stop for _, stop in held[:-1]] == [start for start, _ in held[1:]]
        assert held[0][0] == 0 and held[-1][1] == index.size
        found.append([index[start:stop] for start, stop in held])
    return found


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("layout, cu_seqlens, mask_length", SEQUENCES.values(),
                         ids=SEQUENCES.keys())
def test_pieces_tile_the_sequence_in_maximal_runs(size, layout, cu_seqlens, mask_length):
    found = every_ranks_pieces(size, layout, cu_seqlens, mask_length)
    length = mask_length or cu_seqlens[-1]
    real = [run for held in found for run in held if run[0] >= 0]
    assert all((run >= 0).all() and (np.diff(run) == 1).all() for run in real)
    assert all((run < 0).all() for held in found for run in held if run[0] < 0)
    assert np.array_equal(np.sort(np.concatenate(real)), np.arange(length))
    for held in found:  # maximal: no real piece continues the one before it in the shard
        for before, after in zip(held, held[1:]):
            assert before[0] < 0 or after[0] < 0 or after[0] != before[-1] + 1


@pytest.mark.parametrize("size", SIZES)
def test_zigzag_pieces(size):
    """Two pieces a rank, one on the middle rank P - 1 (chunks P - 1 and P
    follow each other), in a sequence without padding."""
    found = every_ranks_pieces(size, "zigzag", [0, 4 * size], None)
    assert [len(held) for held in found] == [1 if rank == size - 1 else 2
                                             for rank in range(size)]


def test_bad_local_length():
    with pytest.raises(ValueError, match="positive int"):
        pieces(SimpleNamespace(size=2, rank=0), 0, layout="contiguous")
