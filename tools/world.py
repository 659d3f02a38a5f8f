"""The communicator every CLI command runs on."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import commlib


@contextmanager
def world(check: Optional[Callable[[int], None]] = None) -> Iterator[commlib.Communicator]:
    """A host (MPI) communicator over the launch (NCCL is never set up: the
    CLI moves host arrays), freed on the way out. ``check(size)`` runs first:
    usage errors that depend only on the arguments and the world size are
    then raised alike on every rank before any traffic. With peers, a later
    uncaught error on one rank aborts the job instead of hanging the others."""
    comm = commlib.init(backend="mpi")
    try:
        if check is not None:
            check(comm.size)
        if comm.size > 1:
            commlib.abort_on_exception()
        yield comm
    finally:
        comm.free()
