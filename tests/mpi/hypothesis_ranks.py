"""Hypothesis on every rank: rank 0 searches, every other rank runs the
examples rank 0 draws.

Hypothesis alone does not draw the same examples in every process, even with
``derandomize=True``: it mixes in constants found in the modules a process
has loaded, and labels strategies by hashes that differ between processes
(CI at 3 ranks: one rank drew seed 0 while the others drew 18278, and the
collectives of different examples met). So only rank 0 runs Hypothesis; each
example and each ``data.draw`` is broadcast, and the others follow. Shrinking
and the final replay on rank 0 are examples like any other.
"""

import functools
import inspect
from typing import Any, Callable

from hypothesis import given
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from mpi4py import MPI

_WORLD = MPI.COMM_WORLD


class _Abandoned(Exception):
    """Rank 0's Hypothesis gave up the example while drawing (rejected or
    too large): the followers drop it too."""


class _LeaderData:
    """``st.data()`` on rank 0: draws, then tells the followers."""

    def __init__(self, data: st.DataObject):
        self._data = data

    def draw(self, strategy: st.SearchStrategy, label: Any = None) -> Any:
        try:
            value = self._data.draw(strategy, label)
        except BaseException:
            _WORLD.bcast(("abandoned", None))
            raise
        return _WORLD.bcast(("value", value))[1]


class _FollowerData:
    """``st.data()`` on the other ranks: the value rank 0 drew."""

    def draw(self, strategy: st.SearchStrategy, label: Any = None) -> Any:
        kind, value = _WORLD.bcast(None)
        if kind == "abandoned":
            raise _Abandoned
        return value


def given_on_every_rank(**strategies: st.SearchStrategy) -> Callable:
    """``hypothesis.given`` for tests that run on every rank of a launch.
    The test's other parameters are pytest fixtures, as with ``given``."""

    def decorate(test: Callable) -> Callable:
        signature = inspect.signature(test)
        fixtures = [p for name, p in signature.parameters.items() if name not in strategies]

        @functools.wraps(test)
        def run(**fixture_values):
            if _WORLD.rank == 0:
                _lead(test, strategies, fixture_values)
            else:
                _follow(test, fixture_values)

        run.__signature__ = signature.replace(parameters=fixtures)
        return run

    return decorate


def _lead(test, strategies, fixture_values):
    def example(**drawn):
        data_names = [name for name, value in drawn.items()
                      if isinstance(value, st.DataObject)]
        plain = {name: value for name, value in drawn.items() if name not in data_names}
        _WORLD.bcast(("example", (plain, data_names)))
        test(**fixture_values, **plain,
             **{name: _LeaderData(drawn[name]) for name in data_names})

    example.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in strategies])
    example.__name__ = example.__qualname__ = test.__qualname__
    try:
        given(**strategies)(example)()
    except BaseException:
        _WORLD.bcast(("end", True))
        raise
    _WORLD.bcast(("end", False))


def _follow(test, fixture_values):
    failure = None
    while True:
        kind, payload = _WORLD.bcast(None)
        if kind == "end":
            break
        plain, data_names = payload
        try:
            test(**fixture_values, **plain, **{name: _FollowerData() for name in data_names})
        except (_Abandoned, UnsatisfiedAssumption):
            pass
        except Exception as error:  # rank 0 reports the example; keep following
            failure = failure or error
    if failure is not None:
        raise failure
    if payload:
        raise AssertionError("rank 0's Hypothesis search found a failing example: "
                             "rank 0's report shows it")
