"""Sub-communicators the algorithms make belong to the communicator they
were made from: made once, freed with it, refused after."""

import numpy as np
import pytest

import commlib
from commlib import hybrid
from commlib.hybrid.attention import groups

from conftest import all_ranks, raises_everywhere


def test_the_hybrid_groups_are_made_once_and_freed_with_their_communicator():
    parent = commlib.init()
    q = np.random.default_rng(0).standard_normal((1, 4, parent.size, 8)).astype(np.float32)
    for degree in sorted({1, parent.size}):
        hybrid.hybrid_attention(q, q, q, parent, degree, layout="contiguous")
    made = {degree: groups(parent, degree) for degree in sorted({1, parent.size})}
    again = all(groups(parent, degree) == pair for degree, pair in made.items())
    parent.free()
    children = [child for pair in made.values() for child in pair]
    refused = []
    for child in children:
        with pytest.raises(commlib.CommlibError, match="freed"):
            child.barrier()
        refused.append(True)
    assert all_ranks(again and len(refused) == len(children))


def test_an_attention_call_on_a_freed_communicator_is_refused():
    parent = commlib.init()
    parent.free()
    q = np.zeros((1, 4, 2, 8), np.float32)
    raises_everywhere(commlib.CommlibError,
                      lambda: hybrid.hybrid_attention(q, q, q, parent, 1, layout="contiguous"),
                      match="freed")
