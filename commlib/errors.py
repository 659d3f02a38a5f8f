"""Exceptions raised by commlib.

Every error a collective raises because of bad input is raised on *every*
rank that takes part, so that no rank is left waiting in a collective for a
peer that already gave up.
"""

from __future__ import annotations


class CommlibError(RuntimeError):
    """Base class for commlib's own runtime failures."""


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with arguments that do not agree
    (shapes, dtypes, counts), or one of them rejected its own input.

    Raised on every rank; the message names the ranks and what differed.
    """


class CommTimeoutError(CommlibError, TimeoutError):
    """A collective did not complete before the deadline (``COMMLIB_TIMEOUT``)."""


class BackendUnavailableError(CommlibError):
    """A backend was asked for where it cannot run (no GPU, no NCCL, no CuPy)."""


class PeerFailedError(CommlibError):
    """Another rank gave up on the collective this rank is in (it timed out,
    rejected data it could not hold, or failed), and told this rank so."""


class AllocationRefusedError(CommlibError, MemoryError):
    """Receiving what the peers announced would need more memory than this
    rank has available; refused before allocating."""


class LaunchError(CommlibError):
    """The launcher started several processes, but MPI made each a world of
    its own: the launcher and the MPI library do not talk (``srun`` without
    ``--mpi``, another MPI's ``mpiexec``)."""
