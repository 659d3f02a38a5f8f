"""How ranks choose GPUs and when NCCL is used, on every rank together, with
the GPU queries stood in for (so it runs on any machine): ranks that share a
GPU fall back to MPI under "auto" and are named under "nccl"; one rank's bad
``device=`` stops every rank."""

import socket

import pytest

import commlib
from commlib.backends import nccl

from conftest import all_ranks, raises_everywhere

# ranks sharing a GPU: pairs, and two hosts of 2
WORLD_SIZES = (2, 4)


class _FakeNccl:
    """Stands in for NcclBackend: records which device it was given."""

    name = "nccl"

    def __init__(self, host, device_index):
        self.device_index = device_index

    def free(self):
        pass


def on_this_host(identity):
    """A GPU's identity as ranks on different hosts see it: the same bus id
    on two hosts is two GPUs (the real identity, a UUID, differs)."""
    return f"{identity} on {socket.gethostname()}"


@pytest.fixture
def gpus(monkeypatch, comm):
    """Make every rank see ``count`` GPUs, ``identity_of(index)`` telling
    which physical GPU a device index is on that rank's host."""
    def install(identity_of, count=8, allowed=False, current=lambda: 0):
        monkeypatch.setattr(nccl, "unavailable_reason", lambda: None)
        monkeypatch.setattr(nccl, "current_device", current)
        monkeypatch.setattr(nccl, "visible_devices", lambda: count)
        monkeypatch.setattr(nccl, "device_identity", lambda index: on_this_host(identity_of(index)))
        monkeypatch.setattr(nccl, "shares_gpus_allowed", lambda: allowed)
        monkeypatch.setattr(nccl, "NcclBackend", _FakeNccl)
    return install


def test_a_gpu_per_rank_builds_nccl_on_the_chosen_device(comm, gpus):
    gpus(lambda index: f"host {index}")
    world = commlib.init(backend="nccl")
    try:
        assert all_ranks(world.backend == "nccl"
                         and world._device.device_index == comm.topology.local_rank)
    finally:
        world.free()


def test_devices_the_ranks_made_current_are_adopted(comm, gpus):
    gpus(lambda index: f"host {index}", current=lambda: comm.size - 1 - comm.rank)
    world = commlib.init(backend="nccl")
    try:
        assert all_ranks(world._device.device_index == comm.size - 1 - comm.rank)
    finally:
        world.free()


def test_cudas_default_device_everywhere_is_not_a_choice(comm, gpus):
    if comm.topology.local_size == 1:
        pytest.skip("one rank's current device is a choice (or the same as its local rank's)")
    gpus(lambda index: f"host {index}", current=lambda: 0)
    world = commlib.init(backend="nccl")
    try:
        assert all_ranks(world._device.device_index == comm.topology.local_rank)
    finally:
        world.free()


def test_device_argument_wins_over_the_current_device(comm, gpus):
    gpus(lambda index: f"host {index}", current=lambda: comm.size - 1 - comm.rank)
    world = commlib.init(backend="nccl", device=comm.rank)
    try:
        assert all_ranks(world._device.device_index == comm.rank)
    finally:
        world.free()


def test_ranks_sharing_a_gpu_fall_back_under_auto_and_are_named_under_nccl(comm, gpus):
    if comm.topology.local_size == 1:
        pytest.skip("one rank on a host cannot share a GPU")
    gpus(lambda index: "host 0000:01:00.0")  # every rank of a host lands on one GPU
    world = commlib.init(backend="auto")
    try:
        assert all_ranks(world.backend == "mpi")
    finally:
        world.free()
    error = raises_everywhere(commlib.BackendUnavailableError,
                              lambda: commlib.init(backend="nccl"))
    others = ", ".join(str(r) for r in comm.topology.ranks_of(comm.topology.node)
                       if r != comm.rank)
    assert (f"rank {comm.rank}: shares GPU {on_this_host('host 0000:01:00.0')} with rank(s) "
            f"{others}") in str(error)


def test_sharing_is_allowed_where_nccl_allows_it(comm, gpus):
    gpus(lambda index: "host 0000:01:00.0", allowed=True)
    world = commlib.init(backend="nccl")
    try:
        assert all_ranks(world.backend == "nccl")
    finally:
        world.free()


def test_a_bad_device_on_one_rank_stops_every_rank(comm, gpus):
    gpus(lambda index: f"host {index}", count=2)
    bad = comm.size - 1
    error = raises_everywhere(
        commlib.BackendUnavailableError,
        lambda: commlib.init(backend="nccl", device=5 if comm.rank == bad else comm.rank % 2))
    assert f"rank {bad}: device=5 is not one of the 2 visible CUDA devices" in str(error)
    world = commlib.init(backend="auto", device=5 if comm.rank == bad else comm.rank % 2)
    try:
        assert all_ranks(world.backend == "mpi")
    finally:
        world.free()


def test_shared_gpus_lists_only_gpus_with_several_ranks():
    assert nccl.shared_gpus(["a", "b", "a", "c", "a"]) == {"a": [0, 2, 4]}
    assert nccl.shared_gpus(["a", "b"]) == {}
