"""The tiers of the suite. ``quick`` (the default: the README's
``python -m pytest``) runs every public feature at least once, multi-rank
at 2 and 3 ranks, the conformance matrices sampled; ``full``
(``COMMLIB_TEST_TIER=full``, what CI runs) runs everything: every test, every
world size each multi-rank file names, the whole matrices at 2 and 3 ranks.
``sampled`` is the full tier's tests with the quick tier's samples of the
parametrized cases and matrices: what the full tier runs in the launches that
repeat a world's coverage for another reason (one rank, the degenerate
world; 4 ranks on two hosts, for the transport and the 2 x 2 grids; the
rerun with ``COMMLIB_CHECK=1``), so that the whole matrices run where their
layouts differ, at 2 and 3 ranks, and once.

A test that only the full tier runs carries ``@pytest.mark.full`` (a file:
``pytestmark = pytest.mark.full``); a parametrized test marked
``@pytest.mark.quick_sample(n)`` runs n of its cases in the quick tier,
spread evenly over them, and all of them in the full tier. The quick tier
deselects the rest and says so in pytest's header and summary, so nothing
is left out unseen."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

TIER_ENV = "COMMLIB_TEST_TIER"
TIERS = ("quick", "sampled", "full")


def tier() -> str:
    """The tier this run is: ``COMMLIB_TEST_TIER``, quick by default."""
    value = os.environ.get(TIER_ENV, "").strip() or "quick"
    if value not in TIERS:
        raise ValueError(f"{TIER_ENV}={value!r}: give one of {', '.join(TIERS)}")
    return value


def full() -> bool:
    return tier() == "full"


def samples() -> bool:
    """Whether this tier runs samples of the parametrized cases (quick,
    sampled) or all of them (full)."""
    return tier() != "full"


# XLA's CPU backend without LLVM's optimization passes: JAX programs compile
# in about two thirds of the time (a JAX case compiles for seconds and runs for
# milliseconds); the full tier compiles them as users do at 2 ranks, and
# quickly in the launches at other sizes, which compile the same programs
# at other shapes (3 ranks: 106 s -> 66 s for two JAX-heavy files)
QUICK_XLA_FLAG = "--xla_backend_optimization_level=0"


def quick_xla_flags() -> str:
    """``XLA_FLAGS`` with ``QUICK_XLA_FLAG`` added, unless the environment
    already sets an optimization level."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags:
        return flags
    return f"{flags} {QUICK_XLA_FLAG}".strip()


def compile_quickly() -> None:
    """In the quick tier, ``quick_xla_flags()`` as ``XLA_FLAGS`` (before JAX
    starts its backend; the launches' ranks inherit it)."""
    if not full():
        os.environ["XLA_FLAGS"] = quick_xla_flags()


def sampled(items: List) -> List:
    """``items`` (pytest items, in collection order) less the cases a
    ``quick_sample(n)`` marker leaves out: of each such test's cases, n
    spread evenly (the first and the last among them). Cases marked ``gpu``
    stay (they run where a GPU is and skip, saying so, elsewhere), and do
    not count among the n."""
    groups: Dict[Tuple[str, str], List] = {}
    for item in items:
        if item.get_closest_marker("quick_sample") is not None \
                and item.get_closest_marker("gpu") is None:
            groups.setdefault((item.module.__name__, item.originalname), []).append(item)
    dropped = set()
    for cases in groups.values():
        count = cases[0].get_closest_marker("quick_sample").args[0]
        keep = {round(i * (len(cases) - 1) / (count - 1)) for i in range(count)} \
            if count > 1 else {0}
        dropped |= {id(case) for index, case in enumerate(cases) if index not in keep}
    return [item for item in items if id(item) not in dropped]
