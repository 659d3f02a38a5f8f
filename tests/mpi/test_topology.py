"""Topology from the hardware and emulated with ranks_per_node."""

import pytest
from mpi4py import MPI

import commlib

from conftest import raises_everywhere

# one node, a pair, two hosts of 2
WORLD_SIZES = (1, 2, 4)


def test_each_host_is_one_node(comm):
    """Nodes are the hosts the ranks run on (one machine: one node; the
    emulated cluster of CI: one per host), by the host names MPI reports."""
    hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    names = sorted(set(hosts), key=hosts.index)  # nodes in order of their first rank
    mine = [r for r in range(comm.size) if hosts[r] == hosts[comm.rank]]
    assert comm.size == MPI.COMM_WORLD.Get_size()
    assert comm.topology.num_nodes == len(names)
    assert comm.topology.node == names.index(hosts[comm.rank])
    assert comm.topology.ranks_of(comm.topology.node) == tuple(mine)
    assert comm.topology.local_rank == mine.index(comm.rank)
    assert comm.topology.local_size == len(mine)
    assert not comm.topology.emulated


def test_emulated_nodes(comm):
    for per_node in [d for d in range(1, comm.size + 1) if comm.size % d == 0]:
        c = commlib.init(ranks_per_node=per_node)
        try:
            t = c.topology
            assert t.emulated and t.num_nodes == comm.size // per_node
            assert t.node == comm.rank // per_node and t.local_rank == comm.rank % per_node
            assert t.ranks_of(t.node) == tuple(range(t.node * per_node, (t.node + 1) * per_node))
        finally:
            c.free()


def test_emulated_from_environment(comm, monkeypatch):
    monkeypatch.setenv("COMMLIB_RANKS_PER_NODE", "1")
    c = commlib.init()
    try:
        assert c.topology.num_nodes == comm.size and c.topology.emulated
    finally:
        c.free()


@pytest.mark.parametrize("per_node", ["size+1", "zero"])
def test_ranks_per_node_must_divide(comm, per_node):
    value = comm.size + 1 if per_node == "size+1" else 0
    raises_everywhere(ValueError, lambda: commlib.init(ranks_per_node=value),
                      match="does not divide" if value else "positive integer")


def test_communicator_is_a_duplicate(comm):
    assert comm.mpi_comm != MPI.COMM_WORLD
    assert MPI.Comm.Compare(comm.mpi_comm, MPI.COMM_WORLD) == MPI.CONGRUENT
