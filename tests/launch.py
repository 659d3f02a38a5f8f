"""Launch commands under mpiexec with a hard time limit, so that a hang is a
failed test and never a stuck CI run. ``COMMLIB_TEST_LAUNCHER`` picks
another launcher (Open MPI's ``mpirun``, ``srun``) for every launch. Every
launch shares JAX's persistent compilation cache with the others of this
session."""

from __future__ import annotations

import atexit
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from commlib.tools.world import mpiexec_path

TESTS = Path(__file__).resolve().parent


LAUNCHER_ENV = "COMMLIB_TEST_LAUNCHER"
# launches of a world size that divides evenly go across this many emulated
# hosts (commlib.tools.cluster; root only), nodes that MPI detects for real
HOSTS_ENV = "COMMLIB_TEST_HOSTS"


def mpiexec() -> str:
    """The mpiexec beside this Python (the MPI wheel's), else on PATH."""
    found = mpiexec_path()
    if found is None:
        raise RuntimeError("mpiexec not found: pip install mpich (or put a system MPI on PATH)")
    return found


@functools.lru_cache(maxsize=None)
def launcher() -> Tuple[str, ...]:
    """The command that starts ranks, before ``-n P``: ``COMMLIB_TEST_LAUNCHER``
    (say ``mpirun``, or ``srun -K -O --mpi=pmi2``), else ``mpiexec()``.
    Open MPI's launcher gets ``--oversubscribe``: the suite runs more
    ranks than a CI machine has cores, on purpose."""
    chosen = os.environ.get(LAUNCHER_ENV, "").strip()
    command = shlex.split(chosen) if chosen else [mpiexec()]
    if Path(command[0]).name in ("mpiexec", "mpirun") and _is_open_mpi(command[0]):
        command.append("--oversubscribe")
    return tuple(command)


def _is_open_mpi(program: str) -> bool:
    try:
        version = subprocess.run([program, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in version


def hosts_for(nprocs: int) -> int:
    """The emulated hosts a launch of ``nprocs`` ranks spans: ``COMMLIB_TEST_HOSTS``
    where it divides ``nprocs`` into hosts of more than one rank, else 1."""
    raw = os.environ.get(HOSTS_ENV, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{HOSTS_ENV}={raw!r}: give the number of emulated hosts (2), or "
                         f"unset it for one host")
    hosts = int(raw)
    if hosts > 1 and os.environ.get(LAUNCHER_ENV, "").strip():
        raise ValueError(f"{HOSTS_ENV} and {LAUNCHER_ENV} both set: the emulated hosts are "
                         f"launched by MPICH's mpiexec; unset one of them")
    return hosts if nprocs % hosts == 0 and nprocs // hosts > 1 else 1


@functools.lru_cache(maxsize=None)
def jax_cache_env() -> Dict[str, str]:
    """JAX's persistent compilation cache in a directory of this session's
    (removed at exit): each rank of a launch, and each launch, would compile
    the same programs again. Every program is kept, however quick to
    compile: eager JAX compiles each small operation for each shape. (JAX
    never caches a program with host callbacks: the binding's jitted
    collectives are compiled anew each time.)"""
    directory = tempfile.mkdtemp(prefix="commlib-jax-cache-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return {"JAX_COMPILATION_CACHE_DIR": directory,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def run(nprocs: int, argv: List[str], timeout: float, env: Optional[Dict[str, str]] = None,
        hosts: int = 1) -> subprocess.CompletedProcess:
    """``launcher() -n nprocs argv...`` (across ``hosts`` emulated hosts
    where more than one), with ``jax_cache_env()`` unless the environment
    sets those variables; on timeout the whole process group is killed and
    ``subprocess.TimeoutExpired`` raised."""
    full_env = {**jax_cache_env(), **os.environ, **(env or {})}
    start = [*launcher()] if hosts == 1 else \
        [sys.executable, "-m", "commlib.tools.cluster", "run", "--quiet", "--hosts", str(hosts)]
    proc = subprocess.Popen([*start, "-n", str(nprocs), *argv], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)
