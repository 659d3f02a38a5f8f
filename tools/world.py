"""The communicator every CLI command runs on."""

from __future__ import annotations

import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import click

import commlib


@contextmanager
def world(check: Optional[Callable[[int], None]] = None,
          backend: str = "mpi") -> Iterator[commlib.Communicator]:
    """A communicator over the launch (``backend`` "mpi": host arrays only,
    NCCL is not set up), freed on the way out. ``check(size)`` runs first:
    usage errors that depend only on the arguments and the world size are
    then raised alike on every rank before any traffic. With peers, a later
    uncaught error on one rank aborts the job instead of hanging the others."""
    try:
        comm = commlib.init(backend=backend)
    except commlib.BackendUnavailableError as error:  # the same on every rank
        raise click.BadParameter(str(error), param_hint="'--backend'") from None
    try:
        if check is not None:
            check(comm.size)
        if comm.size > 1:
            commlib.abort_on_exception()
        yield comm
    finally:
        comm.free()


def mpiexec_path() -> Optional[str]:
    """The mpiexec beside this Python (the mpich wheel's, in a venv), else
    the one on PATH (None: there is none)."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")
