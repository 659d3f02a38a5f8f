"""``commlib.init``: from an MPI launch to a Communicator.

Every wait in it has the deadline: MPI's blocking setup calls run only
after the ranks have confirmed, under ``COMMLIB_TIMEOUT``, that all of them
arrived."""

from __future__ import annotations

import math
import os
from typing import Optional

from . import progress
from . import topology as _topology
from .abort import abort_on_exception
from .backends.mpi import MpiBackend
from .communicator import Communicator
from .consistency import check_from_env
from .errors import BackendUnavailableError
from .launcher import check_world_size
from .watchdog import share_cores, timeout_from_env, wait_alone

BACKENDS = ("auto", "mpi", "nccl")


def init(backend: str = "auto", *, mpi_comm=None, ranks_per_node: Optional[int] = None,
         timeout: Optional[float] = None, check: Optional[bool] = None,
         abort_on_error: bool = False, device: Optional[int] = None) -> Communicator:
    """Create a Communicator over a duplicate of ``mpi_comm`` (default
    ``MPI.COMM_WORLD``; a plain ``python`` run is a world of one).

    ``backend``: "mpi" moves host arrays only; "nccl" also moves CUDA arrays
    over NCCL and fails with the reason where it cannot run; "auto" is "nccl"
    when every rank has CuPy, NCCL and a GPU of its own and MPI runs at
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default), else "mpi" (ranks sharing a
    GPU cannot form an NCCL communicator unless NCCL allows it).
    ``device``: the CUDA device this rank drives (default: the device the
    user already made current, e.g. with ``torch.cuda.set_device``, where the
    ranks of a node made distinct ones current; else the rank's index among
    the ranks of its node, modulo the visible devices).
    ``ranks_per_node`` (or ``COMMLIB_RANKS_PER_NODE``) emulates nodes of that
    many consecutive ranks; by default nodes are the shared-memory domains.
    ``timeout`` (default ``COMMLIB_TIMEOUT``, else 600 s; 0 waits forever)
    bounds every wait, this call's own included (a rank that never calls
    ``init`` makes the others raise ``CommTimeoutError``); ``check``
    (default ``COMMLIB_CHECK``) makes every collective first check that all
    ranks agree on its arguments.
    ``abort_on_error`` installs ``commlib.abort_on_exception()``.
    Raises ``LaunchError`` where the launcher started several processes but
    MPI made each a world of one (``srun`` without ``--mpi``).
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

    if mpi_comm is None:
        check_world_size(MPI.COMM_WORLD.Get_size())
    seconds = math.inf if timeout == 0 else timeout
    host = MpiBackend(_duplicate(mpi_comm if mpi_comm is not None else MPI.COMM_WORLD,
                                 seconds), seconds)
    try:
        shared_rank, leader, shared_size, cores = _shared_memory_domain(host.comm)
        share_cores(shared_size, cores)
        progress.share_cores(shared_size, cores)
        topology = _discover_topology(host, leader, ranks_per_node)
        gpu = _device_backend(host, backend, shared_rank, leader, device) \
            if backend != "mpi" else None
    except BaseException:
        host.free()
        raise
    return Communicator(host, topology, gpu, check)


def _duplicate(parent, timeout: float):
    """A private duplicate of the caller's communicator, under the deadline
    (``MPI_Comm_dup`` has none): ``Idup``, then an ``Ibarrier`` on the
    duplicate. A rank that finished both knows that every rank has the
    duplicate, so the blocking calls that follow (the control
    communicator's ``Dup``, ``Alltoall_init``, ``Split_type``) cannot wait
    for a rank that gave up on the first."""
    comm, request = parent.Idup()
    wait_alone(request, timeout, "init (duplicating the MPI communicator)", comm)
    wait_alone(comm.Ibarrier(), timeout, "init (checking that every rank has its duplicate)",
               comm)
    return comm


def _shared_memory_domain(comm):
    """(this rank's index among the ranks sharing its memory, the lowest rank
    of ``comm`` among them, how many they are, how many cores they may run
    on together): the hardware's view of a node. The cores are the union of
    the ranks' affinities, not the machine's count: a cpuset (Slurm, a
    container, ``taskset``) can give a node's ranks fewer cores than it has.
    Every rank of ``comm`` is known to have arrived (``_duplicate``)."""
    from mpi4py import MPI

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        cores = set().union(*shared.allgather(sorted(os.sched_getaffinity(0))))
        return (shared.Get_rank(), shared.allreduce(comm.Get_rank(), op=MPI.MIN),
                shared.Get_size(), len(cores))
    finally:
        shared.Free()


def _discover_topology(host: MpiBackend, leader: int,
                        ranks_per_node: Optional[int]) -> _topology.Topology:
    emulate = _topology.ranks_per_node_from_env(ranks_per_node)
    if emulate is not None:
        return _topology.emulated(host.rank, host.size, emulate)
    return _topology.from_node_leaders(host.rank, host.allgather_object(leader))


def _adopted_device(host: MpiBackend, leader: int) -> Optional[int]:
    """The device the user already made current on this rank (say
    ``torch.cuda.set_device(local_rank)`` before ``init``), when the ranks of
    its node made distinct ones current: a choice, not CUDA's default of 0
    everywhere. Otherwise None. Collective."""
    from .backends import nccl

    mine = nccl.current_device()
    reports = host.allgather_object((leader, mine))
    node = [current for node_leader, current in reports if node_leader == leader]
    if None in node or len(set(node)) < len(node):
        return None
    return mine


def _thread_level_reason() -> Optional[str]:
    """Why this process's MPI thread level cannot carry the NCCL backend, or
    None. Its launches that wait for peers run on a helper thread while the
    caller's thread polls MPI, and a helper refused by an abort gives up
    there, sending the failure notices: two threads in MPI at once, which
    only ``MPI_THREAD_MULTIPLE`` allows (below it, MPI may corrupt its state)."""
    from mpi4py import MPI

    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return None
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
    return (f"MPI was initialized at thread level {names.get(level, level)}, and the NCCL "
            f"backend calls MPI from a helper thread too, which needs MPI_THREAD_MULTIPLE: "
            f"leave mpi4py.rc.thread_level at its default, 'multiple' (or call "
            f"MPI_Init_thread with MPI_THREAD_MULTIPLE), before MPI is initialized")


def _device_backend(host: MpiBackend, backend: str, shared_rank: int, leader: int,
                    device: Optional[int]):
    """The NCCL backend when every rank can run it on a GPU of its own; the
    decision is taken together so that no rank builds NCCL while another
    does not. Under "auto" any obstacle means MPI (a thread level below
    ``MPI_THREAD_MULTIPLE`` included: the MPI path calls MPI from the
    caller's thread only); under "nccl" it raises ``BackendUnavailableError``
    naming the ranks and what stops them."""
    from .backends import nccl

    if device is None:
        device = _adopted_device(host, leader)
    reason = nccl.unavailable_reason() or _thread_level_reason()
    index = identity = None
    if reason is None:
        index, reason = nccl.local_device(shared_rank, device)
    if reason is None:
        identity = nccl.device_identity(index)
    reports = host.allgather_object((reason, identity))
    problems = {r: why for r, (why, _) in enumerate(reports) if why is not None}
    if not problems and not nccl.shares_gpus_allowed():
        for gpu, ranks in nccl.shared_gpus([gpu for _, gpu in reports]).items():
            for r in ranks:
                problems[r] = (f"shares GPU {gpu} with rank(s) "
                               f"{', '.join(str(o) for o in ranks if o != r)}; NCCL needs one "
                               f"GPU per rank (or NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1)")
    if problems:
        if backend == "auto":
            return None
        detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(problems.items()))
        raise BackendUnavailableError(
            f"backend='nccl' cannot run here ({detail}); use backend='mpi' for host "
            f"arrays, or 'auto' to use NCCL only where it is available")
    return nccl.NcclBackend(host, index)
