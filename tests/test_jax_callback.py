"""Every write a JAX transfer makes into XLA's buffers happens on XLA's
stream: the transfer's outputs and the chain's token (issue 26, item 7: the
token was copied on CuPy's default stream, unordered with XLA's). A GPU
stands in here: a stream pointer, a recording stream block, recording views."""

import contextlib

import requires

requires.module("jax")
from commlib.bindings import jax_collectives  # noqa: E402


class RecordingView:
    """A buffer view that records, for each write, whether XLA's stream was current."""

    def __init__(self, state, writes):
        self.state, self.writes = state, writes

    def __setitem__(self, index, value):
        self.writes.append(self.state["on_xla_stream"])


def test_outputs_and_token_are_written_on_xlas_stream(monkeypatch):
    state, writes, streams = {"on_xla_stream": False}, [], []

    @contextlib.contextmanager
    def on_stream(pointer):
        streams.append(pointer)
        state["on_xla_stream"] = True
        try:
            yield
        finally:
            state["on_xla_stream"] = False

    monkeypatch.setattr(jax_collectives, "_stream_of", lambda ctx: 0xC0FFEE)
    monkeypatch.setattr(jax_collectives, "_on_stream", on_stream)
    monkeypatch.setattr(jax_collectives, "_view",
                        lambda buffer, on_gpu: RecordingView(state, writes))

    def transfer(targets, *views):
        for target in targets:
            target[...] = 0

    jax_collectives._transfer_on_xla_stream(transfer, object(), ["token", "out1", "out2"],
                                            "token-in", "in1")
    assert streams == [0xC0FFEE]
    assert writes == [True, True, True]  # out1, out2, then the token
