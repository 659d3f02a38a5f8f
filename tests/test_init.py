"""init and backend selection in a world of one (no mpiexec)."""

import numpy as np
import pytest

import commlib
from commlib.backends import nccl
from commlib.dlpack import Native


def test_world_of_one():
    comm = commlib.init()
    try:
        assert (comm.rank, comm.size, comm.backend) == (0, 1, "mpi")
        y, recv = comm.alltoallv(np.arange(4), [4])
        assert y.tolist() == [0, 1, 2, 3] and recv.tolist() == [4]
    finally:
        comm.free()


def test_unknown_backend():
    with pytest.raises(ValueError, match="use one of auto, mpi, nccl"):
        commlib.init(backend="gloo")


@pytest.mark.skipif(nccl.unavailable_reason() is None, reason="this machine can run NCCL")
def test_nccl_without_gpu_names_what_is_missing():
    with pytest.raises(commlib.BackendUnavailableError, match="backend='nccl' cannot run here"):
        commlib.init(backend="nccl")
    comm = commlib.init(backend="auto")
    try:
        assert comm.backend == "mpi"
    finally:
        comm.free()


def test_cuda_arrays_without_nccl_are_staged_over_mpi():
    from commlib.backends.staged import StagedBackend

    comm = commlib.init(backend="mpi")
    device_array = Native(np.zeros(2), np.dtype(np.float64), True, "cupy", lambda y: y)
    host_array = Native(np.zeros(2), np.dtype(np.float64), False, "numpy", lambda y: y)
    try:
        assert isinstance(comm._backend_for(device_array), StagedBackend)
        with pytest.raises(ValueError, match="host and CUDA arrays were mixed"):
            comm._backend_for(host_array, device_array)
    finally:
        comm.free()


def test_nccl_type_tables():
    assert nccl.reduction_type(np.dtype("float32")) == 7
    assert nccl.reduction_type(np.dtype("bool")) == nccl.reduction_type(np.dtype("uint8"))
    assert nccl.reduction_op(np.dtype("bool"), "sum") == nccl.reduction_op(np.dtype("int8"), "max")
    with pytest.raises(ValueError, match="NCCL cannot reduce complex64"):
        nccl.reduction_type(np.dtype("complex64"))


def test_cuda_arrays_must_be_on_the_communicators_gpu():
    class Device:
        def __init__(self, index):
            self.id = index

    class DeviceArray:  # what a CuPy array shows of its device
        def __init__(self, index):
            self.device = Device(index)

    class FakeNccl:
        name, device_index = "nccl", 1

        def free(self):
            pass

    comm = commlib.init(backend="mpi")
    comm._device = FakeNccl()
    on = [Native(DeviceArray(i), np.dtype(np.float32), True, "cupy", lambda y: y)
          for i in (1, 0)]
    try:
        assert comm._backend_for(on[0]) is comm._device
        with pytest.raises(ValueError, match=r"array 1 of this call is on CUDA device 0, but "
                                             r"this communicator drives device 1"):
            comm._backend_for(*on)
        assert "is on CUDA device 0" in comm._watchdog.failure  # the peers were told
    finally:
        comm.free()
