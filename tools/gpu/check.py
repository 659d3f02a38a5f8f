"""The Python half of ``tools/gpu_check.sh``: the preflight that decides
whether the GPU run is worth its minutes, and the one-line summary of each
pytest step, read from its junit reports (which pytest writes even when the
step's time limit interrupts it).

    python -m commlib.tools.gpu.check preflight --site DIR [--rehearse]
    python -m commlib.tools.gpu.check summary STEP REPORT.xml...
    python -m commlib.tools.gpu.check nccl-peers [--rehearse]

A failed preflight check says what to fix; the script stops there rather
than spend the lent machine's minutes on steps that cannot work.
"""

from __future__ import annotations

import collections
import importlib
import importlib.metadata
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import click

from commlib.tools.nccl_version import nccl_version, nccl_version_text

# imported by the steps: each must import before any step runs
STEP_MODULES = ("commlib.bindings.torch", "commlib.bindings.jax", "commlib.bindings.transformers",
                "commlib.tools.gpu.bench")
MPI4PY_FLOOR = (4, 1)  # pyproject.toml's lower bound
NCCL_MULTI_RANK_GPU = 23000  # NCCL 2.30: several ranks of a communicator on one GPU
# one write per rank: unbuffered, print() writes its parts apart and two ranks' interleave
WORLD_OF_TWO = ("import sys; from mpi4py import MPI; w = MPI.COMM_WORLD; "
                "library = MPI.Get_library_version().splitlines()[0].strip(); "
                "sys.stdout.write(f'rank {w.Get_rank()} of {w.Get_size()}: {library}\\n')")


class PreflightError(Exception):
    """A check that failed: what is wrong, then what to do."""


@dataclass(frozen=True)
class Setting:
    """Where the preflight runs: the checkout, the install's site directory,
    and whether a GPU must be there (the real run) or must not be needed
    (the rehearsal on a CPU machine)."""

    repo: Path
    site: Path
    rehearse: bool


def _run(argv: Sequence[str], timeout: float, cwd: Path,
         env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``argv``'s outcome; one that cannot start or overruns ``timeout`` is a
    failed check, not a crash of the preflight."""
    try:
        return subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise PreflightError(f"`{' '.join(argv)}` did not finish within {timeout:g}s") from None
    except FileNotFoundError:
        raise PreflightError(f"{argv[0]} is not on PATH") from None


def check_install(setting: Setting) -> str:
    """commlib imports from the install, not from the checkout's source tree
    (which has no bindings/ or tools/: they exist only in the install)."""
    import commlib
    where = Path(commlib.__file__).resolve()
    if setting.site.resolve() not in where.parents:
        raise PreflightError(f"commlib imports from {where.parent}, not from the install in "
                             f"{setting.site}: run with PYTHONSAFEPATH=1 and "
                             f"PYTHONPATH={setting.site}, as gpu_check.sh does")
    return f"commlib from {where.parent}"


def check_imports(setting: Setting) -> str:
    """Every module a step imports, and the versions the numbers belong to."""
    for name in STEP_MODULES:
        try:
            importlib.import_module(name)
        except Exception as error:  # any failure here stops the run
            raise PreflightError(f"import {name} failed: {type(error).__name__}: {error}; "
                                 f"carry what is missing in .whl/ (tools/gpu/wheels.txt, "
                                 f"then gpu_check.sh --prepare)") from error
    names = ("torch", "jax", "jaxlib", "transformers", "cupy-cuda13x", "numpy", "mpi4py")
    return ", ".join(f"{name} {_version(name)}" for name in names)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def check_nccl(setting: Setting) -> str:
    """CuPy's NCCL loads; with a GPU, commlib can build a communicator on it."""
    from cupy.cuda import nccl as cupy_nccl

    from commlib.backends import nccl
    if not getattr(cupy_nccl, "available", False):
        raise PreflightError(f"CuPy finds no NCCL library: {nccl.install_hint()}")
    found = f"NCCL {nccl_version()}"
    why_not = nccl.unavailable_reason()
    if setting.rehearse:
        return f"{found}; GPU: {why_not or 'present'} (rehearsal: not needed)"
    if why_not is not None:
        raise PreflightError(f"commlib cannot use NCCL here: {why_not}")
    return found


def check_frameworks_see_the_gpu(setting: Setting) -> str:
    """torch and JAX both see the GPU (a CPU build or a missing CUDA plugin
    would turn every GPU test into a skip)."""
    import jax
    import torch
    found = (f"torch: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA'}"
             f"; jax: {jax.default_backend()}")
    if setting.rehearse:
        return f"{found} (rehearsal: not needed)"
    if not torch.cuda.is_available():
        raise PreflightError(f"torch {torch.__version__} sees no CUDA device: {found}")
    if jax.default_backend() != "gpu":
        raise PreflightError(f"JAX runs on {jax.default_backend()}, not the GPU: is "
                             f"jax-cuda13-plugin installed and does it load? ({found})")
    return found


def check_world_of_two(setting: Setting) -> str:
    """mpiexec starts two ranks that form one MPI world."""
    floor = ".".join(map(str, MPI4PY_FLOOR))
    version = _version("mpi4py")
    if version == "absent" or tuple(int(p) for p in version.split(".")[:2]) < MPI4PY_FLOOR:
        raise PreflightError(f"mpi4py {version} is older than commlib's floor {floor}: carry "
                             f"an mpi4py>={floor} cp3{sys.version_info.minor} wheel in .whl/")
    done = _run(["mpiexec", "-n", "2", sys.executable, "-c", WORLD_OF_TWO], 60, setting.repo)
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    if done.returncode != 0 or [line[:11] for line in lines] != ["rank 0 of 2", "rank 1 of 2"]:
        raise PreflightError(f"mpiexec -n 2 did not form a world of 2 (exit {done.returncode}): "
                             f"{(done.stdout + done.stderr).strip()[-600:]}; the MPI library "
                             f"comes from the carried mpich wheel (MPI4PY_LIBMPI)")
    return lines[0].partition(": ")[2]


def check_collection(setting: Setting) -> str:
    """pytest collects every gpu test, single-process and multi-rank, with
    no errors (a broken import would otherwise show as a step of 0 tests)."""
    counts = []
    for where, env in (("tests", {}), ("tests/mpi", {"COMMLIB_TEST_UNDER_MPIEXEC": "1"})):
        done = _run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q",
                     "-p", "no:cacheprovider", where], 120, setting.repo, env)
        last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        if done.returncode != 0:
            raise PreflightError(f"pytest -m gpu --collect-only {where} failed (exit "
                                 f"{done.returncode}): {done.stdout[-1500:]}{done.stderr[-500:]}")
        counts.append(f"{where}: {last}")
    return "; ".join(counts)


CHECKS: List[Callable[[Setting], str]] = [check_install, check_imports, check_nccl,
                                          check_frameworks_see_the_gpu, check_world_of_two,
                                          check_collection]


@click.group()
def main() -> None:
    """gpu_check.sh's preflight and step summaries."""


@main.command()
@click.option("--site", type=click.Path(exists=True, file_okay=False, path_type=Path),
              required=True, help="Where gpu_check.sh installed commlib.")
@click.option("--rehearse", is_flag=True, help="A CPU machine: a GPU is not needed.")
def preflight(site: Path, rehearse: bool) -> None:
    """Run every check; exit 1, naming the fix, if any failed."""
    setting = Setting(Path.cwd(), site, rehearse)
    failed = 0
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        # announced first: a check that hangs until the step's limit is named by the log
        click.echo(f"  ...    {name}")
        started = time.perf_counter()
        try:
            found, outcome = check(setting), "ok    "
        except PreflightError as error:
            failed += 1
            found, outcome = str(error), "FAILED"
        click.echo(f"  {outcome} {name} ({time.perf_counter() - started:.1f} s): {found}")
    if failed:
        raise SystemExit(f"gpu_check: preflight: {failed} of {len(CHECKS)} checks failed; fix "
                         f"them before spending GPU time on the steps")


def nccl_version_code() -> int:
    """The NCCL CuPy loads, as its version code (23206 for 2.32.6)."""
    from cupy.cuda import nccl as cupy_nccl

    return int(cupy_nccl.get_version())


@main.command("nccl-peers")
@click.option("--rehearse", is_flag=True, help="A CPU machine: report, never refuse.")
def nccl_peers(rehearse: bool) -> None:
    """Exit 0 when several ranks can share the one GPU in one NCCL
    communicator (NCCL 2.30+, with NCCL_MULTI_RANK_GPU_ENABLE=1); else say why
    and exit 1: without it every multi-rank step runs the staged MPI path."""
    try:
        code = nccl_version_code()
    except Exception as error:  # noqa: BLE001 - every failure is the answer
        code, found = 0, f"NCCL unknown ({type(error).__name__}: {error})"
    else:
        found = f"NCCL {nccl_version_text(code)}"
    if rehearse:
        click.echo(f"{found}; rehearsal: the NCCL steps run, on the MPI path (no GPU here)")
    elif code >= NCCL_MULTI_RANK_GPU:
        click.echo(f"{found}: ranks share the GPU with NCCL_MULTI_RANK_GPU_ENABLE=1")
    else:
        raise SystemExit(f"{found}: ranks share one GPU in an NCCL communicator from NCCL "
                         f"2.30 only, so nothing here runs NCCL between ranks")


@main.command()
@click.argument("step")
@click.argument("reports", nargs=-1, type=click.Path(path_type=Path))
def summary(step: str, reports: Sequence[Path]) -> None:
    """One line for STEP from its junit REPORTS (one per rank)."""
    click.echo(summarize(step, reports))


def summarize(step: str, reports: Sequence[Path]) -> str:
    """Counts over every rank's report, the commonest skip reasons and the
    first failures, or why there is nothing to count."""
    present = [p for p in reports if p.is_file()]
    if not present:
        return f"{step}: no junit report: the step was killed before pytest wrote one"
    outcomes: collections.Counter = collections.Counter()
    backends: collections.Counter = collections.Counter()
    skips: collections.Counter = collections.Counter()
    failures: List[str] = []
    for report in present:
        try:
            root = ElementTree.parse(report).getroot()
        except ElementTree.ParseError as error:
            return f"{step}: unreadable junit report {report}: {error}"
        # tests/mpi/conftest.py records the transport each launch chose
        backends.update(p.get("value") for p in root.iter("property")
                        if p.get("name") == "commlib_backend")
        cases = root.iter("testcase")
        for case in cases:
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            found = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
            outcome = found[0] if found else "passed"
            outcomes[outcome] += 1
            if outcome == "skipped":
                skips[(case.find("skipped").get("message") or "")[:100]] += 1
            elif outcome != "passed":
                failures.append(name)
    counts = ", ".join(f"{outcomes[o]} {o}" for o in ("passed", "failure", "error", "skipped")
                       if outcomes[o])
    line = f"{step}: {counts or 'no tests'} over {len(present)} report(s)"
    if backends:
        line += "; backend " + ", ".join(f"{name} on {n}" for name, n in sorted(backends.items()))
    if skips:
        line += "; skipped: " + "; ".join(f"{n} x {r}" for r, n in skips.most_common(2))
    if failures:
        line += "; failed: " + ", ".join(failures[:5])
    return line


if __name__ == "__main__":
    main()
