"""The two tiers of the suite. ``quick`` (the default: the README's
``python -m pytest``) runs every public feature at least once, multi-rank
at 2 and 3 ranks, the conformance matrices sampled; ``full``
(``COMMLIB_TEST_TIER=full``, what CI runs) runs everything: every test, every
world size each multi-rank file names, the whole matrices.

A test that only the full tier runs carries ``@pytest.mark.full`` (a file:
``pytestmark = pytest.mark.full``); the quick tier deselects it, and says so
in pytest's header and summary, so nothing is left out unseen."""

from __future__ import annotations

import os

TIER_ENV = "COMMLIB_TEST_TIER"
TIERS = ("quick", "full")


def tier() -> str:
    """The tier this run is: ``COMMLIB_TEST_TIER``, quick by default."""
    value = os.environ.get(TIER_ENV, "").strip() or "quick"
    if value not in TIERS:
        raise ValueError(f"{TIER_ENV}={value!r}: give one of {', '.join(TIERS)}")
    return value


def full() -> bool:
    return tier() == "full"
