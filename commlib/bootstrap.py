"""``commlib.init``: from an MPI launch to a Communicator."""

from __future__ import annotations

import math
from typing import Optional

from . import topology as _topology
from .abort import abort_on_exception
from .backends.mpi import MpiBackend
from .communicator import Communicator
from .consistency import check_from_env
from .errors import BackendUnavailableError
from .watchdog import timeout_from_env

BACKENDS = ("auto", "mpi", "nccl")


def init(backend: str = "auto", *, mpi_comm=None, ranks_per_node: Optional[int] = None,
         timeout: Optional[float] = None, check: Optional[bool] = None,
         abort_on_error: bool = False) -> Communicator:
    """Create a Communicator over a duplicate of ``mpi_comm`` (default
    ``MPI.COMM_WORLD``; a plain ``python`` run is a world of one).

    ``backend``: "mpi" moves host arrays only; "nccl" also moves CUDA arrays
    over NCCL and fails with the reason where it cannot run; "auto" is "nccl"
    when every rank has CuPy, NCCL and a GPU, else "mpi".
    ``ranks_per_node`` (or ``COMMLIB_RANKS_PER_NODE``) emulates nodes of that
    many consecutive ranks; by default nodes are the shared-memory domains.
    ``timeout`` (default ``COMMLIB_TIMEOUT``, else 600 s; 0 waits forever)
    bounds every wait; ``check`` (default ``COMMLIB_CHECK``) makes every
    collective first check that all ranks agree on its arguments.
    ``abort_on_error`` installs ``commlib.abort_on_exception()``.
    Collective: every rank of ``mpi_comm`` calls it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if timeout is None:
        timeout = timeout_from_env()
    elif not timeout >= 0:
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    check = check_from_env() if check is None else bool(check)
    if abort_on_error:
        abort_on_exception()
    from mpi4py import MPI

    comm = (mpi_comm if mpi_comm is not None else MPI.COMM_WORLD).Dup()
    try:
        shared_rank, leader = _shared_memory_domain(comm)
        topology = _discover_topology(comm, leader, ranks_per_node)
    except BaseException:
        comm.Free()
        raise
    host = MpiBackend(comm, math.inf if timeout == 0 else timeout)
    try:
        device = _device_backend(host, backend, shared_rank) if backend != "mpi" else None
    except BaseException:
        host.free()
        raise
    return Communicator(host, topology, device, check)


def _shared_memory_domain(comm):
    """(this rank's index among the ranks sharing its memory, the lowest rank
    of ``comm`` among them): the hardware's view of a node."""
    from mpi4py import MPI

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return shared.Get_rank(), shared.allreduce(comm.Get_rank(), op=MPI.MIN)
    finally:
        shared.Free()


def _discover_topology(comm, leader: int, ranks_per_node: Optional[int]) -> _topology.Topology:
    rank, size = comm.Get_rank(), comm.Get_size()
    emulate = _topology.ranks_per_node_from_env(ranks_per_node)
    if emulate is not None:
        return _topology.emulated(rank, size, emulate)
    return _topology.from_node_leaders(rank, comm.allgather(leader))


def _device_backend(host: MpiBackend, backend: str, shared_rank: int):
    """The NCCL backend when every rank can run it; the decision is taken
    together so that no rank builds NCCL while another does not."""
    from .backends import nccl

    reasons = host.allgather_object(nccl.unavailable_reason())
    missing = {r: why for r, why in enumerate(reasons) if why is not None}
    if missing:
        if backend == "auto":
            return None
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(missing.items()))
        raise BackendUnavailableError(
            f"backend='nccl' cannot run here ({detail}); use backend='mpi' for host "
            f"arrays, or 'auto' to use NCCL only where it is available")
    import cupy
    return nccl.NcclBackend(host, shared_rank % cupy.cuda.runtime.getDeviceCount())
