"""A failed rank ends the job.

Under plain mpi4py an uncaught exception ends one rank and leaves the others
inside their next collective until the job's wall-clock limit. With
``abort_on_exception()`` the rank prints who it is and its traceback, then
calls ``MPI_Abort``, which ends every rank of the job with a non-zero exit.
(``python -m mpi4py script.py`` does the same for a whole script.)

The report must leave the process before the abort does. MPICH's
``mpiexec`` exits as soon as the abort reaches it, printing only the output
its per-node proxy forwarded before; a proxy that wakes to find both the
report in the rank's stderr pipe and the abort on its PMI socket forwards
the abort first, and the report is lost (one launch in six, on a loaded
machine). So the rank waits, boundedly, until the launcher has read
its stdout and stderr pipes: whatever the proxy has read, it has forwarded
before it looks at the abort.
"""

from __future__ import annotations

import array
import fcntl
import os
import socket
import stat
import sys
import termios
import threading
import time
import traceback
from typing import Tuple

from .errors import CommlibError
from .watchdog import ROLL_CALL_S

_installed = False

# how long a rank waits for the launcher to read its output before aborting
# anyway (a reader that never reads must not keep a failed job alive)
OUTPUT_FORWARDING_LIMIT_S = 5.0
_FORWARDING_POLL_S = 0.002


def unread_bytes(fd: int) -> int:
    """Bytes written to ``fd`` that its reader has not taken yet, where
    ``fd`` is a pipe (as under mpiexec, mpirun and srun); 0 for anything
    else (a terminal, a file) and where the platform cannot say."""
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return 0
        count = array.array("i", [0])
        fcntl.ioctl(fd, termios.FIONREAD, count)
    except OSError:
        return 0
    return count[0]


def wait_for_output_forwarded(limit_s: float = OUTPUT_FORWARDING_LIMIT_S,
                              fds: Tuple[int, ...] = (1, 2)) -> bool:
    """Flush Python's stdout and stderr, then wait until the reader of each
    of ``fds`` has taken everything written to it, at most ``limit_s``.
    True when it has; False when the limit passed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + limit_s
    while any(unread_bytes(fd) for fd in fds):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_FORWARDING_POLL_S)
    return True


def abort_on_exception(exit_code: int = 1) -> None:
    """Make an uncaught exception, in the main thread or any other, abort
    the whole MPI job. Idempotent."""
    global _installed
    if _installed:
        return
    _installed = True

    def report_and_abort(exc_type, exc, tb, where: str) -> None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        header = (f"commlib: uncaught {exc_type.__name__} on rank {world.Get_rank()} of "
                  f"{world.Get_size()} ({socket.gethostname()}, pid {os.getpid()}, {where}); "
                  f"aborting the job so that no rank waits forever\n")
        sys.stderr.write(header + "".join(traceback.format_exception(exc_type, exc, tb)))
        sys.stderr.flush()
        if issubclass(exc_type, CommlibError):
            # peers that timed out too may still be composing their diagnosis
            # (the roll call): let them print it before the job ends
            time.sleep(ROLL_CALL_S + 0.5)
        wait_for_output_forwarded()
        world.Abort(exit_code)

    def main_thread_hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            sys.__excepthook__(exc_type, exc, tb)
        report_and_abort(exc_type, exc, tb, "main thread")

    def thread_hook(args) -> None:
        if args.exc_type is SystemExit:
            return
        report_and_abort(args.exc_type, args.exc_value, args.exc_traceback,
                         f"thread {args.thread.name if args.thread else '?'}")

    sys.excepthook = main_thread_hook
    threading.excepthook = thread_hook
