"""GPU transfers the host does not wait for, and the thread that watches them.

A stream-ordered transport (NCCL) enqueues its work on a CUDA stream and
returns; the caller's stream waits on an event recorded after it, so the
host never blocks. Two things still need someone to look: the buffers of a
transfer must stay alive until its event fires, and a transfer that never
finishes (a peer died, a rank went elsewhere) must be aborted past the
deadline instead of leaving kernels spinning forever. ``InFlight`` keeps
each transfer's event, buffers and deadline; one daemon thread per process
sweeps them, as PyTorch's ProcessGroupNCCL watchdog does. The thread only
reads events and calls the owner's ``expire``; raising, and telling the
peers, is left to the owner's next call on the main thread.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

# how often the thread looks: deadlines are seconds to minutes, and the
# main thread releases finished transfers itself whenever it adds one
SWEEP_S = 0.05


@dataclass
class Transfer:
    """One enqueued transfer: ``event.done`` says it finished."""

    owner: Any
    event: Any
    keep: tuple
    deadline: float
    what: str
    expire: Callable[[str], None]


class InFlight:
    """The transfers still on their way, across every stream-ordered
    transport of the process."""

    def __init__(self, sweep_s: float = SWEEP_S):
        self._sweep_s = sweep_s
        self._transfers: List[Transfer] = []
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def add(self, owner: Any, event: Any, keep: tuple, timeout: float, what: str,
            expire: Callable[[str], None]) -> None:
        """Watch ``event``: hold ``keep`` until it fires; call ``expire(what)``
        once if it has not fired ``timeout`` seconds from now."""
        deadline = time.monotonic() + timeout if math.isfinite(timeout) else math.inf
        with self._lock:
            self._transfers.append(Transfer(owner, event, keep, deadline, what, expire))
        self.sweep()
        self._start()

    def pending(self, owner: Any) -> int:
        """How many of ``owner``'s transfers have not finished yet."""
        self.sweep()
        with self._lock:
            return sum(t.owner is owner for t in self._transfers)

    def forget(self, owner: Any) -> None:
        """Drop ``owner``'s transfers unwatched (its communicator was aborted:
        NCCL no longer touches their buffers)."""
        with self._lock:
            self._transfers = [t for t in self._transfers if t.owner is not owner]

    def sweep(self) -> None:
        """Release finished transfers; expire those past their deadline."""
        now = time.monotonic()
        with self._lock:
            waiting, late = [], []
            for transfer in self._transfers:
                if not transfer.event.done:
                    (late if now > transfer.deadline else waiting).append(transfer)
            self._transfers = waiting
        for transfer in late:  # outside the lock: expiring aborts, which may take a while
            transfer.expire(transfer.what)

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="commlib-inflight",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self._sweep_s)
            self.sweep()


# the process's one watcher
IN_FLIGHT = InFlight()
