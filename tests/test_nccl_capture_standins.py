"""The NCCL backend around CUDA graph captures, lanes and aborts, without a
GPU (issue 38): the stand-ins of test_nccl_stream_order. What is checked:
a torch CUDA input runs its whole collective on torch's current stream (so
DLPack's handshake orders nothing and NCCL joins a capture of it); the
buffers of a captured launch live until ``free()`` (a graph owns no memory);
a lane is made, and a new link connected, only once nothing of the
communicator is in flight; an abort survives a lane added meanwhile."""

import gc
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import test_nccl_stream_order
from test_nccl_stream_order import _backend, _Comm

from commlib import communicator as communicator_module
from commlib import dlpack
from commlib import in_flight as in_flight_module

world = test_nccl_stream_order.world


class _Buffer:
    """A buffer whose life a weak reference can watch."""


# -- item 3: a captured launch's buffers ---------------------------------------

def test_the_buffers_of_a_captured_launch_live_until_free(world):
    """A replay of the graph reads and writes them: back in CuPy's pool they
    would be handed to the next allocation."""
    backend, _ = _backend(world, capturing=True)
    buffer = _Buffer()
    alive = weakref.ref(buffer)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=(buffer,))()
    del buffer
    gc.collect()
    assert alive() is not None
    assert backend._in_flight._transfers == []  # still not watched: no event read
    backend.free()
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("capturing", [True, False])
def test_temporaries_a_captured_kernel_reads_live_until_free(world, capturing):
    """alltoall_many's parts (read by its concatenate), a shift by 0's source
    (read by its copy): held only while a capture is on."""
    backend, _ = _backend(world, capturing=capturing)
    buffer = _Buffer()
    alive = weakref.ref(buffer)
    backend.hold_if_captured(buffer)
    del buffer
    gc.collect()
    assert (alive() is not None) == capturing
    backend.free()
    gc.collect()
    assert alive() is None


def test_an_uncaptured_launch_keeps_nothing_past_its_transfer(world):
    backend, _ = _backend(world, finished=lambda: True)
    buffer = _Buffer()
    alive = weakref.ref(buffer)
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=(buffer,))()
    del buffer
    backend._in_flight.sweep()
    gc.collect()
    assert alive() is None and backend._captured == []


# -- item 6: an abort beside a lane being added --------------------------------

def test_an_abort_while_a_lane_is_added_aborts_every_lane(world):
    """The in-flight thread aborts while the main thread adds a lane: the
    dictionary changes under the abort's loop ("dictionary changed size
    during iteration" killed the thread)."""
    backend, log = _backend(world)
    added, _ = _backend(world)

    class Lane:
        aborted = 0

        def _abort(self):
            self.aborted += 1
            backend._lanes[2] = added  # the main thread's lane(2), meanwhile

    lane = Lane()
    backend._lanes[1] = lane
    backend._abort()
    assert lane.aborted == 1 and log.aborts == 1


# -- item 5: lanes made and links connected with nothing in flight -------------

def _pending_for(seconds):
    """(finished(), fired): a transfer that finishes ``seconds`` from the
    first look."""
    fired = threading.Event()
    start = []

    def finished():
        start.append(time.monotonic())
        if time.monotonic() - start[0] > seconds:
            fired.set()
        return fired.is_set()
    return finished, fired


def test_a_lane_is_made_only_once_nothing_is_in_flight(world):
    finished, fired = _pending_for(0.2)
    backend, log = _backend(world, finished=finished)
    backend._host = world._host
    made_while_in_flight = []

    def init():
        made_while_in_flight.append(not fired.is_set())
        return _Comm(log)
    backend._nccl.init = init
    backend._connected |= {("send", 0), ("recv", 0)}
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())  # in flight for 0.2 s
    lane = backend.lane(1)
    assert made_while_in_flight == [False] and backend._lanes[1] is lane


def test_a_new_link_is_connected_only_once_nothing_is_in_flight(world):
    finished, fired = _pending_for(0.2)
    backend, log = _backend(world, finished=finished)
    backend._connected |= {("send", 0), ("recv", 0)}
    backend._grouped([(0, 8, 0)], [(0, 8, 0)], keep=())  # in flight for 0.2 s
    sent_while_in_flight = []
    send = backend.comm.send

    def watched(*args):
        sent_while_in_flight.append(not fired.is_set())
        send(*args)
    backend.comm.send = watched
    backend._grouped([(0, 8, 1)], [(0, 8, 1)], keep=())  # a new peer: connects
    assert sent_while_in_flight == [False]


# -- item 2: torch CUDA input on torch's current stream ------------------------

class _ExternalStream:
    """cupy.cuda.ExternalStream: entered, CuPy's current stream."""

    current = []

    def __init__(self, ptr, device_id=-1):
        self.ptr, self.device_id = ptr, device_id

    def __enter__(self):
        _ExternalStream.current.append(self.ptr)
        return self

    def __exit__(self, *args):
        _ExternalStream.current.pop()


class _FakeCupy:
    class cuda:
        ExternalStream = _ExternalStream

        class runtime:
            @staticmethod
            def getDevice():
                return 0


class _Device:
    type, index = "cuda", 0


class _CudaTensor:
    """What callers_stream reads of a torch CUDA tensor."""

    is_cuda = True
    device = _Device()


_CudaTensor.__module__ = "torch"


@pytest.fixture
def torch_stream(monkeypatch):
    """Torch's current stream on device 0 is 0xBEEF; CuPy stood in for."""
    import torch

    class Stream:
        cuda_stream = 0xBEEF
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    _ExternalStream.current.clear()


def test_a_torch_cuda_tensor_makes_torchs_current_stream_cupys(torch_stream):
    with dlpack.callers_stream(_CudaTensor()):
        assert _ExternalStream.current == [0xBEEF]
    with dlpack.callers_stream([_CudaTensor(), _CudaTensor()]):  # alltoall_many
        assert _ExternalStream.current == [0xBEEF]
    assert _ExternalStream.current == []


def test_host_arrays_and_other_devices_leave_cupys_stream_alone(torch_stream):
    import torch

    class OnDevice1(_CudaTensor):
        class device:
            type, index = "cuda", 1
    for x in (np.ones(2), torch.ones(2), [np.ones(2)], OnDevice1(), None, []):
        with dlpack.callers_stream(x):
            assert _ExternalStream.current == []


def test_every_collective_and_wait_runs_inside_the_callers_stream(world, monkeypatch):
    """From the unwrap (DLPack's handshake) to the result's wrap, including
    an async transfer's wait."""
    inside = []

    class Scope:
        def __init__(self, x):
            self.x = x

        def __enter__(self):
            inside.append(self.x)

        def __exit__(self, *args):
            inside.pop()
    unwrapped_inside = []
    unwrap = communicator_module.unwrap

    def watched_unwrap(x):
        unwrapped_inside.append(bool(inside))
        return unwrap(x)
    monkeypatch.setattr(communicator_module, "callers_stream", Scope)
    monkeypatch.setattr(in_flight_module, "callers_stream", Scope)  # a transfer's wait
    monkeypatch.setattr(communicator_module, "unwrap", watched_unwrap)
    x = np.arange(4.0)
    calls = {
        "alltoallv": lambda: world.alltoallv(x, [4]),
        "alltoallv_async": lambda: world.alltoallv_async(x, [4]).wait(),
        "alltoall": lambda: world.alltoall(x),
        "alltoall_many": lambda: world.alltoall_many([x, x]),
        "ring_shift": lambda: world.ring_shift(x),
        "ring_shift_async": lambda: world.ring_shift_async(x).wait(),
        "allgather": lambda: world.allgather(x),
        "allreduce": lambda: world.allreduce(x),
        "bcast": lambda: world.bcast(x),
    }
    outside = []
    for name, call in calls.items():
        unwrapped_inside.clear()
        call()
        if not unwrapped_inside or not all(unwrapped_inside):
            outside.append(name)
    assert not outside

    waited_inside = []
    pending = world.ring_shift_async(x)
    wait = pending._wait
    pending._wait = lambda: (waited_inside.append(bool(inside)), wait())
    np.testing.assert_array_equal(pending.wait(), x)
    assert waited_inside == [True]

