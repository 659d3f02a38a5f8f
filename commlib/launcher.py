"""What the launcher started, against what MPI joined.

A launcher that cannot reach the MPI library (``srun --mpi=none``, or an
``mpiexec`` of another MPI than the one mpi4py loaded) starts N processes
that each find a world of one. Each would then train the whole model alone,
silently; ``init`` refuses instead, on every process, and says which
launcher setting to change.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

from .errors import LaunchError

# (variable, launcher): MPI launchers' own first, since an MPI launcher
# running inside a Slurm step inherits the step's task count as well
_TASK_COUNTS = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)"),
    ("SLURM_STEP_NUM_TASKS", "srun"),
)


def launched_tasks(environ: Mapping[str, str] = os.environ) -> Optional[Tuple[int, str]]:
    """(processes started, by which launcher), from the launcher's
    environment; None where no launcher says."""
    for variable, launcher in _TASK_COUNTS:
        raw = environ.get(variable, "").strip()
        if raw.isdigit():
            return int(raw), launcher
    return None


def check_world_size(world_size: int, environ: Mapping[str, str] = os.environ) -> None:
    """Raise ``LaunchError`` where the launcher started more processes than
    the MPI world holds (each process a singleton)."""
    launched = launched_tasks(environ)
    if launched is None or world_size != 1 or launched[0] <= 1:
        return
    tasks, launcher = launched
    if launcher == "srun":
        fix = ("srun gave the MPI library no process-management interface (PMI): launch "
               "with `srun --mpi=pmi2` for the mpich wheel, or `srun --mpi=pmix` for Open "
               "MPI (Slurm built with PMIx); `srun --mpi=list` shows what this Slurm offers")
    else:
        fix = ("the launcher belongs to another MPI than the one mpi4py loaded (`commlib "
               "info` names it): launch with that MPI's own mpiexec, e.g. the one in "
               "this Python's bin folder")
    raise LaunchError(f"{launcher} started {tasks} processes, but MPI sees a world of 1 on "
                      f"each: {fix}. To run independent single-process jobs on purpose, "
                      f"pass mpi_comm=MPI.COMM_SELF to commlib.init")
