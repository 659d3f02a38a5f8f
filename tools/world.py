"""The launch every CLI command runs in: its communicator, the mpiexec
beside this Python, and how its topology reads."""

from __future__ import annotations

import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import click

import commlib
from commlib.topology import RANKS_PER_NODE_ENV, Topology


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


def describe_topology(topology: Topology) -> str:
    """Nodes, ranks per node, and where the node boundaries come from."""
    per_node = [len(topology.ranks_of(node)) for node in range(topology.num_nodes)]
    ranks = (plural(per_node[0], "rank") + " per node" if topology.is_uniform
             else "ranks per node " + ",".join(map(str, per_node)))
    source = f"emulated by {RANKS_PER_NODE_ENV}" if topology.emulated else "from shared memory"
    return f"{plural(topology.num_nodes, 'node')}, {ranks} ({source})"


def plural(count: int, noun: str) -> str:
    """``1 rank``, ``3 ranks``."""
    return f"{count} {noun}{'s' if count != 1 else ''}"
