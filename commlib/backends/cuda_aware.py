"""Is the MPI library CUDA-aware, that is, does it take device pointers?

``detect()`` answers True, False or None (unknown), with the reason, from
the first of these that says something:

1. ``COMMLIB_MPI_CUDA_AWARE=1`` or ``0`` (for sites where the query below is
   missing or wrong; set it on every rank);
2. mpi4py's own query, if this mpi4py has one (4.1 does not);
3. ``MPIX_Query_cuda_support()``, which Open MPI and MPICH (>= 4) export
   from their shared library: found through the library mpi4py loaded and
   called with ctypes. MPICH built without GPU support (the ``mpich`` wheel)
   returns 0;
4. the MPI 4.1 ``mpi_memory_alloc_kinds`` info key of ``MPI_COMM_SELF``:
   "cuda" or "cuda:device" among the kinds means device memory is accepted.

Unknown is treated as not CUDA-aware: device buffers are then staged
through host memory (``backends.staged``), which is correct everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from typing import Iterable, Mapping, NamedTuple, Optional

ENV = "COMMLIB_MPI_CUDA_AWARE"
_SYMBOL = "MPIX_Query_cuda_support"
_KINDS_KEY = "mpi_memory_alloc_kinds"
# the MPI shared libraries of Open MPI, MPICH and their derivatives, the MPI ABI one included
_MPI_LIBRARY = re.compile(r"/lib(mpi|mpich)[^/]*\.so[^/]*$")


class Support(NamedTuple):
    aware: Optional[bool]  # None: unknown
    reason: str


def detect(environ: Optional[Mapping[str, str]] = None) -> Support:
    """Whether device buffers may go straight to MPI, and why. The
    environment is read on every call, the library asked once per process."""
    override = from_env(os.environ if environ is None else environ)
    return override if override is not None else _library_answer()


def describe(support: Support) -> str:
    """The decision in words, what it means for CUDA arrays over MPI, and
    why (``commlib info`` prints this)."""
    if support.aware:
        decision = "CUDA-aware: CUDA arrays over MPI go to it as device buffers"
    elif support.aware is None:
        decision = ("unknown, so not CUDA-aware: CUDA arrays over MPI are staged through "
                    "host memory")
    else:
        decision = "not CUDA-aware: CUDA arrays over MPI are staged through host memory"
    return f"{decision} ({support.reason})"


def from_env(environ: Mapping[str, str]) -> Optional[Support]:
    """``COMMLIB_MPI_CUDA_AWARE``'s answer; None when unset or "auto"."""
    raw = environ.get(ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in ("1", "true", "yes", "on"):
        return Support(True, f"{ENV}={raw}")
    if raw in ("0", "false", "no", "off"):
        return Support(False, f"{ENV}={raw}")
    raise ValueError(f"{ENV}={raw!r}: use 1 if this MPI takes CUDA device buffers, 0 to "
                     f"stage them through host memory, or auto (the default) to ask the "
                     f"MPI library")


@functools.lru_cache(maxsize=1)
def _library_answer() -> Support:
    from mpi4py import MPI
    return ask_library(MPI, _loaded_libraries(MPI))


def ask_library(mpi, libraries: Iterable) -> Support:
    """What the MPI library says: ``mpi`` is the ``mpi4py.MPI`` module (or a
    stand-in), ``libraries`` ctypes handles in which to look for
    ``MPIX_Query_cuda_support``."""
    query = getattr(mpi, "Query_cuda_support", None)
    if callable(query):
        answer = bool(query())
        return Support(answer, f"mpi4py's MPI.Query_cuda_support() returned {answer}")
    for library in libraries:
        function = getattr(library, _SYMBOL, None)
        if function is None:
            continue
        function.restype, function.argtypes = ctypes.c_int, []
        answer = int(function())
        where = getattr(library, "_name", None) or "the MPI library"
        return Support(answer == 1, f"{_SYMBOL}() in {where} returned {answer}")
    kinds = _memory_kinds(mpi)
    if kinds is not None:
        aware = any(kind == "cuda" and restrictor in ("", "device")
                    for kind, _, restrictor in (k.strip().partition(":")
                                                for k in kinds.split(",")))
        return Support(aware, f"MPI_COMM_SELF's {_KINDS_KEY} is {kinds!r}")
    return Support(None, f"the MPI library exports no {_SYMBOL} and reports no "
                         f"{_KINDS_KEY}; set {ENV}=1 if it takes CUDA device buffers")


def _memory_kinds(mpi) -> Optional[str]:
    """The MPI 4.1 memory allocation kinds, or None where not reported."""
    try:
        info = mpi.COMM_SELF.Get_info()
    except Exception:  # an MPI older than 3, or a stand-in without it
        return None
    try:
        return info.Get(_KINDS_KEY)
    finally:
        info.Free()


def _loaded_libraries(mpi) -> Iterable:
    """ctypes handles to search: each MPI library mapped into this process
    (Linux), then mpi4py's extension module (its handle also finds the
    symbols of the libmpi it links)."""
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if _MPI_LIBRARY.search(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    paths.append(mpi.__file__)
    for path in paths:
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue
