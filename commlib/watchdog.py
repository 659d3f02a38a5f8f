"""Every wait in commlib goes through here.

A ``Watchdog`` belongs to one communicator. It polls nonblocking work (MPI
requests, a CUDA stream) against a deadline (``COMMLIB_TIMEOUT``) while
listening for *failure notices*: small messages on a private control
communicator by which a rank that gives up on a call (bad input found after
the count exchange, a timeout, memory it refuses to allocate) tells its
peers, so that they raise too instead of waiting forever.

MPI has no timed wait, so waiting is a loop of ``Test`` calls, each of
which also moves large transfers along. Where the node has a core per rank
the loop just polls (a yield between polls cost 20% at 16 MiB); with more
ranks than cores it yields the processor between polls
(``os.sched_yield``), or a rank spinning in Python would starve the very
peer it waits for.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import CommlibError, CommTimeoutError, PeerFailedError

TIMEOUT_ENV = "COMMLIB_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
NOTICE_TAG = 7301
NOTICE_BYTES = 1024
# after a timeout, how long to listen for peers that are stuck as well
ROLL_CALL_S = 2.0
# how long free() waits for the peers' notice counts: they free together,
# unless one died (then it frees without them, as before)
DRAIN_S = 5.0
# polls between clock reads: reading the clock costs as much as a poll
_POLLS_PER_CLOCK = 32
# polls before a wait sets up its deadline, where ranks have a core each
# (~0.3 us a poll: a small message is there within them)
SPIN_POLLS = 64
_spin_polls = SPIN_POLLS


def share_cores(ranks_on_node: int, cores_on_node: int) -> None:
    """Told by ``init``: with more ranks on this node than the cores they
    may run on, waits yield between polls from the first; otherwise they
    poll without yielding. For the whole process: it is a property of the node."""
    global _spin_polls
    _spin_polls = SPIN_POLLS if ranks_on_node <= cores_on_node else 0


# communicators that failed or did not drain, with their abandoned requests
# and buffers: never freed (see Watchdog.close)
_retired: List[tuple] = []
# watchdogs whose notice receive is still posted (held, so that a forgotten
# communicator's receive is still withdrawn): cancelled at exit, before
# mpi4py finalizes MPI (atexit runs handlers last-registered first)
_listening: "set[Watchdog]" = set()


@atexit.register
def _stop_listening() -> None:
    for watchdog in list(_listening):
        watchdog.stop_listening()


@atexit.register
def _release_finished_requests() -> None:
    """Free the retired requests that have finished by now: an unfreed one
    still holds its communicator (MPICH warns at exit of a builtin one, such
    as init's abandoned duplicate of COMM_WORLD)."""
    if not _retired:
        return
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    for _, held, _ in _retired:
        for item in held:
            if isinstance(item, MPI.Request) and not isinstance(item, MPI.Prequest):
                item.Test()


def timeout_from_env() -> float:
    """Seconds from ``COMMLIB_TIMEOUT`` (default 600); 0 or "inf" wait forever."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds; "
                         f"use a positive number, or 0 to wait forever")
    return math.inf if seconds == 0 else seconds


class Watchdog:
    """Deadline, call counter and failure notices of one communicator."""

    def __init__(self, control, timeout: float):
        from mpi4py import MPI

        self._mpi = MPI
        self.control = control
        self.rank = control.Get_rank()
        self.size = control.Get_size()
        self.timeout = timeout
        self.calls = 0
        self.op = "init"
        self.failure: Optional[str] = None
        self.freed: Optional[str] = None  # how the communicator was freed, once it is
        self._on_failure: List[Callable[[], None]] = []
        self._sent: List = []  # outgoing notices, kept alive until freed
        # notices sent to / heard from each peer: all must be received before
        # the control communicator is freed (see drain)
        self._sent_to = [0] * self.size
        self._heard_from = [0] * self.size
        self._abandoned: List = []  # requests and buffers of calls given up on
        # set by a thread watching the GPU: the reason, and whether it was the deadline
        self._expired: Optional[Tuple[str, bool]] = None
        self._notice_buffer = bytearray(NOTICE_BYTES)
        self._notice = self._post_notice_receive()
        _listening.add(self)

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when this communicator fails (this rank gives
        up, or a peer's notice arrives): a device transport aborts its
        in-flight GPU work there."""
        self._on_failure.append(callback)

    def _fail(self, failure: str) -> None:
        self.failure = failure
        for callback in self._on_failure:
            callback()

    # -- a call's life ---------------------------------------------------------
    def begin(self, op: str) -> None:
        """A new collective starts: refuse if this communicator already
        failed, and pick up any notice a peer sent in between."""
        self.check_usable()
        self.calls += 1
        self.op = op
        if self.size > 1 and self._notice.Test():
            self._fail_from_notice()

    def wait_requests(self, requests: Sequence, peers: Optional[Sequence[int]] = None) -> None:
        """Until every MPI request completes. ``peers[i]`` is the rank that
        request i talks to (None for a collective), to name the missing."""
        # one request: its own Test (cheaper, and MPICH's Testall reports a
        # spurious error for a persistent collective)
        done = requests[0].Test if len(requests) == 1 else \
            (lambda: self._mpi.Request.Testall(requests))
        for _ in range(_spin_polls + 1):
            if done():
                return
        try:
            self.wait_until(done, lambda: _pending_peers(requests, peers))
        except CommlibError:
            # MPI may still write into these buffers: keep them (the requests
            # hold them) alive for as long as the communicator
            self.hold(*requests)
            raise

    def check_usable(self) -> None:
        """Raise if this communicator was freed or failed (or its GPU work
        just expired)."""
        if self.freed is not None:
            raise CommlibError(f"this communicator was freed ({self.freed}); its calls are "
                               f"refused: make a new one with commlib.init() or split()")
        self.raise_if_expired()
        if self.failure is not None:
            raise CommlibError(f"this communicator can no longer be used: {self.failure}. "
                               f"Free it and create a new one, or end the job")

    def hold(self, *objects: Any) -> None:
        """Keep ``objects`` (requests, buffers of a transfer that may still
        be in flight) alive for as long as this communicator."""
        self._abandoned.extend(objects)

    def expire(self, reason: str, *, timed_out: bool = True) -> None:
        """From another thread (the GPU in-flight watcher): work of this
        communicator missed its deadline (``timed_out``) or failed on the GPU.
        This thread raises at its next call or wait, and tells the peers."""
        self._expired = (reason, timed_out)

    def raise_if_expired(self) -> None:
        if self._expired is None or self.failure is not None:
            return
        reason, timed_out = self._expired
        self.give_up(reason)
        if not timed_out:  # the reason says what to do: a longer deadline would not help
            raise CommlibError(reason)
        raise CommTimeoutError(f"{reason}. Raise {TIMEOUT_ENV} (now {self.timeout:g}s) if "
                               f"the GPU is only busy; otherwise a peer died or is in "
                               f"another call: create a new communicator")

    def wait_until(self, done: Callable[[], bool],
                   pending: Callable[[], Optional[List[int]]] = lambda: None) -> None:
        """Poll ``done()`` until true. After the deadline: ``CommTimeoutError``;
        a peer's notice meanwhile: ``PeerFailedError``."""
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not done():
            polls += 1
            self.raise_if_expired()
            if self.size > 1 and self._notice.Test():
                self._fail_from_notice()
            if polls % _POLLS_PER_CLOCK == 0 and time.monotonic() > deadline:
                self._time_out(pending())
            if not _spin_polls:  # ranks share cores
                os.sched_yield()

    # -- failure -----------------------------------------------------------------
    def give_up(self, reason: str) -> None:
        """This rank abandons the current call: tell every peer, and refuse
        further calls on this communicator."""
        if self.failure is None:
            self._broadcast_notice(reason)
            self._fail(f"rank {self.rank} gave up on {self._call()}: {reason}")

    def _call(self) -> str:
        return f"{self.op} (call #{self.calls})"

    def _time_out(self, missing: Optional[List[int]]) -> None:
        reason = (f"timed out after {self.timeout:g}s waiting for "
                  + (f"rank(s) {', '.join(map(str, missing))}" if missing else "its peers"))
        self.give_up(reason)
        stuck = self._roll_call()
        silent = [r for r in range(self.size) if r != self.rank and r not in stuck]
        lines = [f"{self._call()} on rank {self.rank} {reason}."]
        if stuck:
            lines.append("Also waiting: " + "; ".join(
                f"rank {r} in {s['op']} (call #{s['calls']})" for r, s in sorted(stuck.items()))
                + ".")
        if silent:
            lines.append(f"Not heard from: rank(s) {', '.join(map(str, silent))} (crashed, "
                         f"still busy elsewhere, or in a different collective).")
        lines.append(f"Raise {TIMEOUT_ENV} (now {self.timeout:g}s) if they are only slow.")
        raise CommTimeoutError(" ".join(lines))

    def _roll_call(self) -> Dict[int, dict]:
        """Notices that arrive within ROLL_CALL_S: the peers that are in a
        call too (and timing out, or told by us)."""
        heard: Dict[int, dict] = {}
        end = time.monotonic() + min(ROLL_CALL_S, self.timeout)
        while len(heard) < self.size - 1 and time.monotonic() < end:
            if self._notice.Test():
                notice = self._take_notice()
                heard[notice["rank"]] = notice
            else:
                time.sleep(0.001)
        return heard

    def _fail_from_notice(self) -> None:
        notice = self._take_notice()
        failure = (f"rank {notice['rank']} gave up on {notice['op']} "
                   f"(call #{notice['calls']}): {notice['reason']}")
        self._broadcast_notice(f"left because {failure}")
        self._fail(failure)
        raise PeerFailedError(f"{self._call()} on rank {self.rank} was abandoned: "
                              f"{self.failure}")

    def _broadcast_notice(self, reason: str) -> None:
        MPI = self._mpi
        message = json.dumps({"rank": self.rank, "op": self.op, "calls": self.calls,
                              "reason": reason[:NOTICE_BYTES // 2]}).encode()[:NOTICE_BYTES]
        for peer in range(self.size):
            if peer != self.rank:
                self._sent.append(self.control.Isend([message, MPI.BYTE], peer, NOTICE_TAG))
                self._sent_to[peer] += 1

    def _post_notice_receive(self):
        MPI = self._mpi
        return self.control.Irecv([self._notice_buffer, MPI.BYTE], MPI.ANY_SOURCE, NOTICE_TAG)

    def _take_notice(self) -> dict:
        """The notice that arrived, decoded; listen for the next one."""
        text = bytes(self._notice_buffer).rstrip(b"\0").decode(errors="replace")
        self._notice_buffer[:] = bytes(NOTICE_BYTES)
        self._notice = self._post_notice_receive()
        notice = json.loads(text)
        self._heard_from[notice["rank"]] += 1
        return notice

    def stop_listening(self) -> None:
        """Withdraw the posted notice receive (local)."""
        if not self._notice.Test():
            self._notice.Cancel()
            self._notice.Wait()
        _listening.discard(self)

    def drain(self) -> bool:
        """Receive every notice the peers sent on this communicator (they
        say how many) before it is freed: a notice still on its way would
        otherwise be matched against a later communicator that reuses the
        freed one's context, and fail that one. Collective; gives up after
        DRAIN_S (a dead peer's count never comes). True when it settled."""
        if self.size == 1:
            return True
        MPI = self._mpi
        sent = np.array(self._sent_to, np.int64)
        owed = np.zeros(self.size, np.int64)
        exchange = self.control.Ialltoall([sent, MPI.INT64_T], [owed, MPI.INT64_T])
        deadline = time.monotonic() + min(self.timeout, DRAIN_S)

        def settled() -> bool:
            if self._notice.Test():
                self._take_notice()
                return False
            return exchange.Test() and all(
                heard >= due for heard, due in zip(self._heard_from, owed.tolist()))
        while not settled():
            if time.monotonic() > deadline:
                self.hold(exchange, sent, owed)
                return False
            os.sched_yield()
        return True

    def close(self, *comms) -> None:
        """Free the control communicator and ``comms`` (the payload's) once
        nothing more can arrive on them: drained, and no call failed on any
        rank (none given up here, no notice heard). Otherwise keep them,
        unfreed, for the life of the process: a call given up on may still
        have messages on their way (the late rounds of a peer's abandoned
        nonblocking collective, which MPI progresses whenever that peer
        calls it; a late notice; a late peer's half of the drain), and MPI
        would deliver those to whichever later communicator reuses the freed
        context, corrupting it or, under Open MPI, aborting the job. A few
        handles per failure is the price; collective."""
        drained = self.drain()
        self.stop_listening()
        everything = (self.control, *comms)
        if drained and self.failure is None and not any(self._heard_from) \
                and not self._abandoned:
            for comm in everything:
                comm.Free()
        else:
            _retired.append((everything, self._abandoned, self._sent))


def wait_alone(request, timeout: float, what: str, *keep: Any) -> None:
    """Poll one MPI request against ``timeout``, where no communicator (and
    so no failure notice) exists yet: ``init``'s duplicate of the caller's
    communicator. A rank that gives up here cannot tell its peers; each
    finds out at its own deadline. Given up on, ``request`` and ``keep``
    (what it creates) are kept for the life of the process: MPI may still
    complete it."""
    deadline = time.monotonic() + timeout
    while not request.Test():
        if time.monotonic() > deadline:
            _retired.append((keep, [request], []))
            raise CommTimeoutError(
                f"{what} timed out after {timeout:g}s: not every rank of the MPI communicator "
                f"called commlib.init (crashed, still busy elsewhere, or calling it on another "
                f"communicator). Raise {TIMEOUT_ENV} (now {timeout:g}s) if they are only slow.")
        os.sched_yield()


def _pending_peers(requests: Sequence, peers: Optional[Sequence[int]]) -> Optional[List[int]]:
    """The peers whose requests have not completed (None if unknown)."""
    if peers is None:
        return None
    return sorted({peer for request, peer in zip(requests, peers) if not request.Test()})
