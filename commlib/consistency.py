"""Cross-rank consistency: do all ranks agree on what they are doing?

A collective's *fingerprint* is its operation, the facts every rank must
share (dtype, shapes, root, op) and any parameters an algorithm registered
with ``Communicator.fingerprint(...)``. alltoallv carries it for free in its
count exchange, so there the check is always on. Elsewhere it costs one
small all-to-all, so it runs only when ``COMMLIB_CHECK=1``.
"""

from __future__ import annotations

import os
import zlib
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .errors import CollectiveMismatchError

CHECK_ENV = "COMMLIB_CHECK"

Context = Tuple[Tuple[str, Any], ...]


def check_from_env() -> bool:
    raw = os.environ.get(CHECK_ENV, "0").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{CHECK_ENV}={raw!r}: use 1 to check that ranks agree before "
                     f"every collective, or 0 (the default) to check only where it is free")


def describe(op: str, facts: Sequence[Any], context: Context) -> str:
    """The fingerprint in words, for error messages."""
    parts = [op, *map(str, facts)] + [f"{key}={value!r}" for key, value in context]
    return ", ".join(parts)


def signature(op: str, facts: Sequence[Any], context: Context) -> int:
    """A stable non-negative hash of the fingerprint, the same in every process.
    Remembered for facts of exact type str, int, bool or None (whose equal
    values print alike; 1 == 1.0 == True do not) and the same context
    object: a decode loop agrees on the same facts every step, and
    formatting them each time cost more than the exchange's Python (issue 37)."""
    if not all(type(fact) in _PLAIN for fact in facts):
        return zlib.crc32(describe(op, facts, context).encode())
    key = (op, tuple(map(type, facts)), tuple(facts), id(context))
    held = _SIGNATURES.get(key)
    if held is not None and held[0] is context:
        return held[1]
    if len(_SIGNATURES) >= _MOST_SIGNATURES:
        _SIGNATURES.clear()
    value = zlib.crc32(describe(op, facts, context).encode())
    _SIGNATURES[key] = (context, value)  # the context held: its id names no other
    return value


_PLAIN = (str, int, bool, type(None))
_SIGNATURES: dict = {}
_MOST_SIGNATURES = 4096  # distinct fingerprints remembered before starting over


REJECTED = -1  # sent instead of a (non-negative) signature by a rank with bad input


def agree(host, op: str, facts: Sequence[Any], context: Context,
          problem: Optional[Exception] = None,
          carry: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """Raise CollectiveMismatchError on every rank unless all ranks have the
    same fingerprint and none had a ``problem`` with its own input. One
    all-to-all of one int64 per peer. ``carry`` (int64 [size, n], n the
    same on every rank; unused where a rank has a problem) rides along, row
    i to rank i, and the [size, n] rows received come back: counts that
    would otherwise need an exchange of their own (issue 37)."""
    mine = REJECTED if problem is not None else signature(op, facts, context)
    if carry is None:
        received = host.exchange_int64(np.full((host.size, 1), mine, dtype=np.int64))[:, 0]
    else:
        rows = np.empty((host.size, 1 + carry.shape[1]), np.int64)
        rows[:, 0] = mine
        rows[:, 1:] = carry
        exchanged = host.exchange_int64(rows)
        received = exchanged[:, 0]
    if problem is None and (received == mine).all():
        return None if carry is None else exchanged[:, 1:]
    rejected = np.flatnonzero(received == REJECTED)
    if rejected.size:
        raise_disagreement(host, received, str(problem),
                           f"{op} was rejected by rank(s) " + ", ".join(map(str, rejected)),
                           rejected)
    raise_disagreement(host, received, describe(op, facts, context),
                       f"ranks called {op} with different arguments")


def rendezvous(host, op: str, values: Sequence[int], facts: Sequence[Any] = (),
               context: Context = (), problem: Optional[Exception] = None) -> np.ndarray:
    """Bring every rank, under the watchdog's deadline, to a blocking MPI
    call that has none of its own (``MPI_Comm_split``). Round 1 is
    ``agree``: every rank is here, with the same ``op`` and ``facts``, and
    none had a ``problem`` with its arguments (else
    ``CollectiveMismatchError`` on every rank). Round 2 sends every rank
    this rank's ``values`` (int64) and returns them all, [size,
    len(values)]. Finishing round 2 proves that every rank finished round
    1: a rank that gave up there, its deadline passing just before the last
    rank arrived, never posts round 2, so its peers hear its notice instead
    of entering the blocking call without it."""
    agree(host, op, facts, context, problem)
    rows = np.empty((host.size, len(values)), np.int64)
    rows[:] = values
    return host.exchange_int64(rows)


def raise_disagreement(host, signatures: np.ndarray, report: str, headline: str,
                       culprits: Sequence[int] = ()) -> None:
    """Every rank saw the same ``signatures``: gather each rank's ``report``
    and raise the same error everywhere. ``culprits``, when given, are the
    only ranks listed."""
    reports = host.allgather_object(report)
    listed = culprits if len(culprits) else range(host.size)
    lines = "\n  ".join(f"rank {r}: {reports[r]}" for r in listed)
    raise CollectiveMismatchError(f"{headline}:\n  {lines}")
