"""Launch commands under mpiexec with a hard time limit, so that a hang is a
failed test and never a stuck CI run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

TESTS = Path(__file__).resolve().parent


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: pip install mpich (or put a system MPI on PATH)")
    return found


def run(nprocs: int, argv: List[str], timeout: float,
        env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``mpiexec -n nprocs argv...``; on timeout the whole process group is
    killed and ``subprocess.TimeoutExpired`` raised."""
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.Popen([mpiexec(), "-n", str(nprocs), *argv], env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)
