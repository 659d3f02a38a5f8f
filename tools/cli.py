"""The ``commlib`` command line: what a launch sees, and diagnostics.

It is an MPI program like any other: every rank runs the command, rank 0
prints. ::

    mpiexec -n 4 commlib info
    mpiexec -n 4 commlib diag alltoall -b 1K -e 64M --pattern random

``diag`` commands follow nccl-tests (same options, same columns), so their
output reads like the tables people already know. Everything moves host
(NumPy) arrays over the MPI backend; usage errors are found before MPI
starts, identically on every rank, so no rank is left waiting.
"""
from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, packages_distributions, version
from typing import List

import click

import commlib
from commlib.namespace import FRAMEWORKS
from commlib.tools.nccl_version import nccl_version
from commlib.tools.relaunch import relaunchable
from commlib.tools.world import describe_topology, world


# -- commands --------------------------------------------------------------
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(commlib.__version__, prog_name="commlib")
def main() -> None:
    """commlib: collectives for context and expert parallelism.

    Launch like any MPI program (mpiexec -n P commlib ...), or give info or
    a diag command --np P to have it launch itself; rank 0 prints. simulate
    needs no MPI.
    """


@relaunchable
@main.command()
def info() -> None:
    """What this launch sees: MPI library, world, topology, backends
    (whether CUDA arrays go to MPI directly or are staged, and why) and
    array frameworks."""
    with world() as comm:
        if comm.rank == 0:
            click.echo("\n".join(info_lines(comm)))


def info_lines(comm: commlib.Communicator) -> List[str]:
    """The report of ``commlib info``, one line per fact."""
    import mpi4py
    from mpi4py import MPI

    from commlib.backends import nccl

    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    nccl_reason = nccl.unavailable_reason()
    return [
        f"commlib     {commlib.__version__}",
        f"MPI library {library} (mpi4py {mpi4py.__version__})",
        f"world size  {comm.size}",
        f"topology    {describe_topology(comm.topology)}",
        "backends    mpi: available",
        "            nccl: " + ("available" if nccl_reason is None
                                else f"unavailable ({nccl_reason})"),
        f"nccl        {nccl_version()}",
        f"gpus        {_gpu_count()}",
        f"cuda-aware  {_cuda_aware_decision()}",
        "frameworks  " + ", ".join(_framework_status(name) for name in FRAMEWORKS),
    ]


def _gpu_count() -> str:
    """CUDA devices this rank sees, or "unknown" without CuPy or a driver."""
    try:
        import cupy

        return str(cupy.cuda.runtime.getDeviceCount())
    except Exception as error:  # noqa: BLE001 - every failure is reported
        return f"unknown ({type(error).__name__})"


def _cuda_aware_decision() -> str:
    """What ``backends.cuda_aware.detect()`` decides for CUDA arrays over
    MPI, and why: the decision the staged backend acts on. A bad
    ``COMMLIB_MPI_CUDA_AWARE`` is reported, not raised."""
    from commlib.backends import cuda_aware

    try:
        support = cuda_aware.detect()
    except ValueError as error:
        return f"error: {error}"
    return cuda_aware.describe(support)


def _framework_status(module: str) -> str:
    """``torch 2.4.0`` or ``jax: not installed``, found without importing
    the module (importing torch or jax alone takes seconds)."""
    if importlib.util.find_spec(module) is None:
        return f"{module}: not installed"
    distribution = packages_distributions().get(module, [module])[0]
    try:
        return f"{module} {version(distribution)}"
    except PackageNotFoundError:
        return f"{module} (version unknown)"


@main.group()
def diag() -> None:
    """Collective benchmarks with a correctness check, nccl-tests style."""


# commands that live in their own modules (they do not import this one)
from commlib.tools.cluster import cluster  # noqa: E402
from commlib.tools.diag.alltoall import alltoall  # noqa: E402
from commlib.tools.diag.attention import ring as diag_ring  # noqa: E402
from commlib.tools.diag.attention import ulysses as diag_ulysses  # noqa: E402
from commlib.tools.diag.moe import moe  # noqa: E402
from commlib.tools.simulate import simulate  # noqa: E402

for command in (alltoall, moe, diag_ring, diag_ulysses):
    diag.add_command(relaunchable(command))
main.add_command(simulate)
main.add_command(cluster)


if __name__ == "__main__":
    main()
