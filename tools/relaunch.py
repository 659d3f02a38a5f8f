"""``--np N``: a command started outside MPI runs itself again as
``mpiexec -n N`` with the same options; under MPI the option is ignored."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import List, Optional, Sequence

import click

from commlib.tools.world import mpiexec_path

MPI_ENV_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def relaunchable(command: click.Command) -> click.Command:
    """Give ``command`` the ``--np NP`` option: started outside MPI, it runs
    itself again as ``mpiexec -n NP`` with the same options; under MPI the
    option is ignored. Every command that runs under MPI has it."""
    command.params.append(click.Option(
        ["--np", "nprocs"], type=click.IntRange(min=1),
        help="Not under MPI yet: re-launch as mpiexec -n NP with the same options."))
    run_here = command.callback

    @functools.wraps(run_here)
    def run_or_relaunch(*args, nprocs: Optional[int] = None, **kwargs):
        if nprocs is not None and not under_mpi():
            click.get_current_context().exit(relaunch(nprocs, sys.argv[1:]))
        return run_here(*args, **kwargs)

    command.callback = run_or_relaunch
    return command


def under_mpi() -> bool:
    """Whether a launcher (MPICH/Hydra, Open MPI, PMIx) started this process."""
    return any(name in os.environ for name in MPI_ENV_VARS)


def without_np(argv: Sequence[str]) -> List[str]:
    """``argv`` less ``--np N`` / ``--np=N``, for the relaunched command."""
    kept: List[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--np":
            skip = True
        elif not arg.startswith("--np="):
            kept.append(arg)
    return kept


def relaunch(nprocs: int, argv: Sequence[str]) -> int:
    """Run this command again as ``mpiexec -n nprocs`` (the mpiexec beside
    this Python, else on PATH) and return its exit status."""
    launcher = mpiexec_path()
    if launcher is None:
        raise click.UsageError("--np needs mpiexec: pip install mpich, or launch with "
                               "mpiexec yourself")
    command = [launcher, "-n", str(nprocs), sys.executable, "-m", "commlib.tools.cli",
               *without_np(argv)]
    return subprocess.run(command).returncode
