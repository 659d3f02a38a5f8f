"""What a test needs from its environment, and whether its absence is a skip
or an error: the one place that decides, instead of bare
``pytest.importorskip``.

    torch = requires.module("torch")            # at module level or in a test

A framework that is not installed (torch, JAX, transformers, CuPy, ...)
skips the test, with the reason; under ``COMMLIB_TEST_REQUIRE=all`` (what CI
sets) it is an error, so that an environment missing a framework cannot
report green while the tests that need it never ran. A module that is there
but fails to import (a broken install, a bug in commlib) is an error always.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

REQUIRE_ENV = "COMMLIB_TEST_REQUIRE"


def everything_required() -> bool:
    """Whether ``COMMLIB_TEST_REQUIRE=all``: nothing the tests need may be missing."""
    value = os.environ.get(REQUIRE_ENV, "")
    if value not in ("", "all"):
        raise ValueError(f"{REQUIRE_ENV}={value!r}: the only value is 'all' "
                         f"(every framework must be there); unset it to let missing ones skip")
    return value == "all"


def skip_reason(reason: str) -> str:
    """``reason``, for a skip of something missing here; under
    ``COMMLIB_TEST_REQUIRE=all`` an error (``pytest.fail``) instead."""
    if everything_required():
        pytest.fail(f"{reason}, and {REQUIRE_ENV}=all requires it: install it, or unset "
                    f"{REQUIRE_ENV} to let such tests skip", pytrace=False)
    return reason


def module(name: str) -> ModuleType:
    """``import name``, or skip (an error under ``COMMLIB_TEST_REQUIRE=all``)
    where it, or a third-party package it imports, is not installed."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if not error.name or error.name.partition(".")[0] == "commlib":
            raise  # commlib's own modules are always there: a missing one is a bug
        pytest.skip(skip_reason(f"needs {name}: no module named {error.name!r} here"),
                    allow_module_level=True)
