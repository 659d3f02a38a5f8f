"""Progress for MPI transfers left in flight while Python computes.

MPI moves a large message only while some thread is inside the library: a
transfer started before a matmul and waited on after it otherwise sits
still through the matmul and then takes its whole time at the wait
(measured at 2 ranks: a 32 MiB exchange behind 50 ms of compute still took
14-19 ms at the wait; with this thread, 0.1 ms). While any started transfer
is outstanding, one daemon thread per process enters MPI every
``POLL_S`` with an ``Iprobe`` for a tag nothing is sent on: it drives MPI's
progress engine without touching the transfer's own requests (MPI forbids
two threads testing one request), and numpy, torch and JAX kernels release
the GIL, so it runs beside them. It needs ``MPI_THREAD_MULTIPLE`` (two
threads in MPI at once); below it no thread is started, even when asked
for (that is said once on stderr), and the transfers progress at their
wait, as before.

The thread needs a core of its own: moving the bytes through shared memory
is CPU work, and a thread that wakes 10,000 times a second on the core the
experts compute on slows them more than the overlap saves (measured: two
micro-batches 16% slower). So by default it runs only where this rank may
use more than one core and its node has more cores than ranks;
``COMMLIB_PROGRESS_THREAD=1`` or ``0`` decides instead.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

# between visits to MPI: short against a transfer, long against a visit (~1 us)
POLL_S = 1e-4
# a tag no commlib message carries; a probe never takes a message anyway
PROBE_TAG = 7302
THREAD_ENV = "COMMLIB_PROGRESS_THREAD"
_spare_core = False
_told_thread_level = False


def share_cores(ranks_on_node: int, cores_on_node: int) -> None:
    """Told by ``init``: whether a progress thread would have a core to
    itself (see the module docstring): this rank may use more than one,
    and its node's ranks together more than one each."""
    global _spare_core
    _spare_core = len(os.sched_getaffinity(0)) > 1 and ranks_on_node < cores_on_node


class Progress:
    """How many started transfers the process has outstanding, and the
    thread that drives them."""

    def __init__(self, poll_s: float = POLL_S):
        self._poll_s = poll_s
        self._outstanding = 0
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """A transfer is in flight until the matching ``finish()``."""
        with self._wake:
            self._outstanding += 1
            self._wake.notify()
        if self._thread is None and _threads_allowed():
            self._thread = threading.Thread(target=self._drive, name="commlib-progress",
                                            daemon=True)
            self._thread.start()

    def finish(self) -> None:
        with self._wake:
            self._outstanding -= 1

    def _drive(self) -> None:
        """MPI's progress engine is the process's, not a communicator's:
        probing the world drives every transfer (and never takes a message)."""
        from mpi4py import MPI

        while True:
            with self._wake:
                while not self._outstanding:
                    self._wake.wait()
            if MPI.Is_finalized():
                return
            MPI.COMM_WORLD.Iprobe(MPI.ANY_SOURCE, PROBE_TAG)
            time.sleep(self._poll_s)


def _threads_allowed() -> bool:
    global _told_thread_level
    from mpi4py import MPI

    choice = os.environ.get(THREAD_ENV, "").strip()
    wanted = _spare_core if choice not in ("0", "1") else choice == "1"
    if not (wanted and MPI.Is_initialized() and not MPI.Is_finalized()):
        return False
    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        return True
    if choice == "1" and not _told_thread_level:
        _told_thread_level = True
        sys.stderr.write(f"commlib: {THREAD_ENV}=1, but MPI was initialized below "
                         f"MPI_THREAD_MULTIPLE, which a progress thread needs: none is "
                         f"started (leave mpi4py.rc.thread_level at 'multiple')\n")
    return False


# the process's one progress thread
PROGRESS = Progress()
