"""Sub-communicators the algorithms make belong to the communicator they
were made from: made once, freed with it, refused after; and they build a
device transport only where they move device arrays."""

import numpy as np
import pytest

import commlib
from commlib import hybrid
from commlib.hybrid.attention import groups

import requires
from conftest import all_ranks, raises_everywhere

# sub-communicators' lifecycle: one size past 1 shows it
WORLD_SIZES = (2,)


def test_the_hybrid_groups_are_made_once_and_freed_with_their_communicator():
    parent = commlib.init()
    q = np.random.default_rng(0).standard_normal((1, 4, parent.size, 8)).astype(np.float32)
    for degree in sorted({1, parent.size}):
        hybrid.hybrid_attention(q, q, q, parent, degree, layout="contiguous", causal=False)
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
                      lambda: hybrid.hybrid_attention(q, q, q, parent, 1, layout="contiguous",
                                                      causal=False),
                      match="freed")


class RecordingDevice:
    """Stands in for NcclBackend (no GPU here): records the device
    communicators made from it (each split builds one) and freed."""

    name = "nccl"

    def __init__(self, log):
        self.log = log

    def split(self, host):
        self.log.append("split")
        return RecordingDevice(self.log)

    def free(self):
        self.log.append("free")


def with_recording_device():
    parent = commlib.init(backend="mpi")
    log = []
    parent._device = RecordingDevice(log)
    return parent, log


def test_a_split_with_backend_mpi_builds_no_device_communicator():
    parent, log = with_recording_device()
    try:
        host_only = parent.split(0, parent.rank, backend="mpi")
        made_none = log == [] and host_only._device is None
        kept = parent.split(0, parent.rank)
        named = parent.split(0, parent.rank, backend="nccl")
        cached = parent.split(0, parent.rank, cache_key="checks", backend="mpi")
        again = parent.split(0, parent.rank, cache_key="checks", backend="mpi") is cached
        with pytest.raises(ValueError, match="give each split its own cache_key"):
            parent.split(0, parent.rank, cache_key="checks")
        assert all_ranks(made_none and again
                         and (parent.backend, host_only.backend, kept.backend, named.backend,
                              cached.backend) == ("nccl", "mpi", "nccl", "nccl", "mpi")
                         and log == ["split", "split"])
    finally:
        parent.free()
    assert all_ranks(log == ["split", "split", "free", "free", "free"])


@pytest.mark.parametrize("backend, match", [
    ("gloo", "split: backend must be None"),
    ("auto", "split: backend must be None"),
    ("nccl", "a split cannot add NCCL"),
    (0, "split: backend must be None"),
])
def test_a_bad_split_backend_raises_on_every_rank(backend, match):
    parent = commlib.init(backend="mpi")
    try:
        bad = backend if parent.rank == 0 else None  # one rank's mistake is every rank's error
        error = raises_everywhere(commlib.CollectiveMismatchError,
                                  lambda: parent.split(0, parent.rank, backend=bad),
                                  match="split was rejected by rank(s) 0")
        assert all_ranks(match in str(error)), str(error)
        assert all_ranks(parent.split(0, parent.rank).size == parent.size)  # still usable
    finally:
        parent.free()


def test_ranks_that_split_with_different_backends_raise_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    parent, log = with_recording_device()
    try:
        backend = "mpi" if parent.rank == 0 else None
        raises_everywhere(commlib.CollectiveMismatchError,
                          lambda: parent.split(0, parent.rank, backend=backend),
                          match="ranks called split with different arguments")
        assert all_ranks(log == [])
    finally:
        parent.free()


def test_traced_builds_a_device_communicator_for_the_transfers_only():
    traced = requires.module("commlib.bindings.jax._traced_comm").traced
    parent, log = with_recording_device()
    try:
        comm = traced(parent)
        once = log == ["split"] and traced(parent) is comm
        group = comm.split(0, comm.rank, cache_key="group")
        assert all_ranks(once and log == ["split", "split"]
                         and (comm.runtime.backend, comm.checks.backend) == ("nccl", "mpi")
                         and (group.runtime.backend, group.checks.backend) == ("nccl", "mpi"))
    finally:
        parent.free()
