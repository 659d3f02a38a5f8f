"""A failed rank ends the job.

Under plain mpi4py an uncaught exception ends one rank and leaves the others
inside their next collective until the job's wall-clock limit. With
``abort_on_exception()`` the rank prints who it is and its traceback, then
calls ``MPI_Abort``, which ends every rank of the job with a non-zero exit.
(``python -m mpi4py script.py`` does the same for a whole script.)
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback

from .errors import CommlibError
from .watchdog import ROLL_CALL_S

_installed = False


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
