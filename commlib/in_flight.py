"""What a started transfer hands back: ``Pending`` (``wait()`` returns the
result) and a prepared exchange with its in-flight ``Started``. Each holds
the buffers its transfer reads and writes until it is waited on; one dropped
unwaited hands its transfer to the communicator's abandon, so that the next
call raises on every rank instead of hanging."""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .backends import PreparedExchange
from .dlpack import Native, callers_stream
from .progress import PROGRESS


class PreparedAlltoall:
    """``Communicator.prepare_alltoall``'s exchange: ``start()`` begins one
    (counted and checked like any call) and returns its wait. Its arrays
    must not change between a start and its wait."""

    def __init__(self, transport: PreparedExchange, native: Native,
                 begin: Callable[..., None], abandon: Callable[..., None]):
        self._native, self._begin, self._abandon = native, begin, abandon
        self._transport = transport  # holds the arrays until the exchange is gone
        self._facts = (native.dtype, native.data.shape)

    def start(self) -> "Started":
        self._begin("alltoall", *self._facts)
        with callers_stream(self._native):
            return Started(self._transport.start(), self)


class Started:
    """A prepared exchange in flight: calling it waits. Dropped without a
    call, it hands the exchange (its request still active, its buffers still
    written) to the communicator's abandon, like a dropped ``Pending``:
    the next call raises on every rank instead of hanging."""

    def __init__(self, wait: Callable[[], None], prepared: PreparedAlltoall):
        self._wait: Optional[Callable[[], None]] = wait
        self._prepared = prepared

    def __call__(self) -> None:
        wait, self._wait = self._wait, None
        if wait is None:
            raise RuntimeError("this alltoall was already waited on")
        wait()

    def __del__(self):
        if getattr(self, "_wait", None) is not None:
            prepared = self._prepared
            prepared._abandon("alltoall", self._wait, prepared, prepared._transport)


class Pending:
    """A transfer in flight; ``wait()`` returns its result (once). It holds
    the buffer being sent (a contiguous copy of a strided input, say) until
    the transfer is done, so that no transport reads freed memory. Dropped
    without ``wait()``, it hands its transfer to ``abandon``. ``progress``:
    an MPI transfer, driven by the progress thread meanwhile. ``unpack``:
    how the received buffer becomes the result (``alltoall_many_async``'s
    list), instead of the buffer in the caller's framework."""

    def __init__(self, op: str, wait: Callable[[], None], native: Native, out: Any,
                 sending: Any, abandon: Optional[Callable[..., None]], progress: bool = False,
                 recv_counts: Optional[np.ndarray] = None,
                 unpack: Optional[Callable[[Any], Any]] = None):
        self._op, self._wait, self._native, self._out = op, wait, native, out
        self._unpack = unpack
        self._sending, self._abandon = sending, abandon
        self._progress = progress
        self.recv_counts = recv_counts
        if progress:
            PROGRESS.start()

    def wait(self) -> Any:
        if self._abandon is None and self._sending is None:
            raise RuntimeError(f"this {self._op} was already waited on")
        with callers_stream(self._native):
            try:
                self._wait()
            finally:
                if self._progress:
                    self._progress = False
                    PROGRESS.finish()
            self._sending, self._abandon = None, None
            if self._unpack is not None:
                return self._unpack(self._out)
            return self._native.wrap(self._out)

    def __del__(self):
        # an instance torch.compile's tracing made without __init__ holds nothing
        if getattr(self, "_progress", False):
            PROGRESS.finish()
        if getattr(self, "_abandon", None) is not None:
            self._abandon(self._op, self._wait, self._out, self._sending)
