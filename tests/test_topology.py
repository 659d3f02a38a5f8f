"""Topology as data: emulated nodes, hardware leaders, sub-communicators."""

import pytest

from commlib.topology import Topology, emulated, from_node_leaders, ranks_per_node_from_env


def test_emulated_nodes():
    t = emulated(rank=5, size=8, ranks_per_node=4)
    assert (t.num_nodes, t.node, t.local_rank, t.local_size) == (2, 1, 1, 4)
    assert t.ranks_of(0) == (0, 1, 2, 3) and t.node_of(3) == 0 and t.emulated


@pytest.mark.parametrize("per_node, message", [(3, r"use one of \[1, 2, 4, 8\]"),
                                               (0, "positive integer"),
                                               (2.0, "positive integer")])
def test_emulated_rejects(per_node, message):
    with pytest.raises(ValueError, match=message):
        emulated(0, 8, per_node)


def test_nodes_from_leaders_need_not_be_contiguous():
    t = from_node_leaders(rank=2, leader_of_rank=[0, 1, 0, 1, 4])
    assert t.node_of_rank == (0, 1, 0, 1, 2)
    assert t.ranks_of(1) == (1, 3) and t.local_rank == 1 and not t.is_uniform


def test_restrict_keeps_nodes():
    parent = Topology(0, (0, 0, 1, 1, 2, 2))
    sub = parent.restrict([1, 3, 5], rank=1)
    assert sub.node_of_rank == (0, 1, 2) and sub.node == 1


def test_ranks_of_unknown_node():
    with pytest.raises(ValueError, match="nodes 0..0"):
        Topology(0, (0,)).ranks_of(1)


def test_environment(monkeypatch):
    monkeypatch.delenv("COMMLIB_RANKS_PER_NODE", raising=False)
    assert ranks_per_node_from_env(None) is None
    monkeypatch.setenv("COMMLIB_RANKS_PER_NODE", "4")
    assert ranks_per_node_from_env(None) == 4 and ranks_per_node_from_env(2) == 2
    monkeypatch.setenv("COMMLIB_RANKS_PER_NODE", "four")
    with pytest.raises(ValueError, match="not an integer"):
        ranks_per_node_from_env(None)
