"""Every write a JAX transfer makes into XLA's buffers happens on XLA's
stream: the transfer's outputs and the chain's token (issue 26, item 7: the
token was copied on CuPy's default stream, unordered with XLA's). A GPU
stands in here: a stream pointer, a recording stream block, recording views
of the buffers, and a ``buffer_callback`` that calls the callback at once."""

import contextlib

import numpy as np
import pytest

import requires

requires.module("jax")
import jax.numpy as jnp  # noqa: E402

from commlib.bindings.jax import _traced_comm as jax_collectives  # noqa: E402

XLA_STREAM = 0xC0FFEE


class Buffer:
    """One of XLA's buffers, by name."""

    def __init__(self, name):
        self.name = name


class RecordingView:
    """A view of a buffer that records each write: (buffer, on XLA's stream?)."""

    def __init__(self, buffer, state):
        self.buffer, self.state = buffer, state

    def __getitem__(self, index):
        return self

    def __setitem__(self, index, value):
        self.state["writes"].append((self.buffer.name, self.state["on_xla_stream"]))


class Done:
    def wait(self):
        pass


class FakeRuntime:
    """The runtime communicator: writes into the targets it is given, as the
    real one writes into XLA's output buffers."""

    rank, size = 0, 2

    def ring_shift_async(self, send, shift, lane, out):
        out[...] = send
        return Done()

    def alltoall(self, data, out):
        out[...] = data

    def allgather(self, data, axis):
        return data


@pytest.fixture
def gpu_stand_in(monkeypatch):
    """XLA's stream pointer, the stream block and the views, recorded."""
    state = {"on_xla_stream": False, "writes": [], "streams": [], "outputs": []}

    @contextlib.contextmanager
    def on_stream(pointer):
        state["streams"].append(pointer)
        state["on_xla_stream"] = True
        try:
            yield
        finally:
            state["on_xla_stream"] = False

    def buffer_callback(callback, shapes, has_side_effect):
        def run(token, *operands):
            outs = [Buffer("token")] + [Buffer(f"output {i}") for i in range(1, len(shapes))]
            state["outputs"] += [b.name for b in outs]
            callback(object(), outs, Buffer("token in"), *[Buffer("input") for _ in operands])
            return [jnp.zeros(s.shape, s.dtype) for s in shapes]
        return run

    monkeypatch.setattr(jax_collectives, "_stream_of", lambda ctx: XLA_STREAM)
    monkeypatch.setattr(jax_collectives, "_on_stream", on_stream)
    monkeypatch.setattr(jax_collectives, "_view",
                        lambda buffer, on_gpu: RecordingView(buffer, state))
    monkeypatch.setattr(jax_collectives, "buffer_callback", buffer_callback)
    return state


TRANSFERS = {
    "ring_shift": lambda comm, x: comm.ring_shift(x),
    "ring_shift lane 1": lambda comm, x: comm.ring_shift_async(x, 1, lane=1).wait(),
    "alltoall": lambda comm, x: comm.alltoall(x, split_axis=0, concat_axis=1),
    "alltoall_many": lambda comm, x: comm.alltoall_many([x, x.astype(jnp.int8)]),
    "allgather": lambda comm, x: comm.allgather(x, axis=1),
}


@pytest.mark.parametrize("name", TRANSFERS)
def test_every_write_into_xlas_buffers_is_on_xlas_stream(gpu_stand_in, name):
    chain = jax_collectives._Chain()
    chain.token = jnp.zeros((), jnp.uint8)
    comm = jax_collectives.TracedComm(FakeRuntime(), None, chain)
    x = jnp.asarray(np.arange(8, dtype=np.float32).reshape(4, 2))
    TRANSFERS[name](comm, x)
    writes = gpu_stand_in["writes"]
    assert gpu_stand_in["streams"] == [XLA_STREAM]
    assert sorted(buffer for buffer, _ in writes) == sorted(gpu_stand_in["outputs"])
    assert all(on_xla_stream for _, on_xla_stream in writes), writes
