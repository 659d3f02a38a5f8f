"""Multi-rank tests live in tests/mpi/ and run under mpiexec, launched by
tests/test_multirank.py; a plain ``pytest`` collects them only there. What
each launch ran is printed at the end (tests/rank_outcomes.py). The quick
tier leaves out the tests marked ``full`` and compiles JAX's programs
quickly (tests/tiers.py)."""

import os

import tiers
from rank_outcomes import SUMMARY_KEY

tiers.compile_quickly()

if os.environ.get("COMMLIB_TEST_UNDER_MPIEXEC") != "1":
    collect_ignore = ["mpi"]


def pytest_terminal_summary(terminalreporter, config):
    """Passed, failed and skipped (by allowed reason) at each multi-rank launch."""
    lines = config.stash.get(SUMMARY_KEY, [])
    if lines:
        terminalreporter.write_sep("-", "multi-rank launches: what each rank ran")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_report_header(config):
    left = {"quick": f" (tests marked full left out: {tiers.TIER_ENV}=full runs them)",
            "sampled": " (parametrized cases and matrices sampled)"}.get(tiers.tier(), "")
    return f"commlib test tier: {tiers.tier()}{left}"


def pytest_collection_modifyitems(config, items):
    """The quick tier deselects the tests marked ``full``; it and the
    sampled tier keep, of a test marked ``quick_sample(n)``, n of its
    parametrized cases, spread evenly over them (the same ones on every
    rank); pytest counts the rest as deselected in its summary line."""
    if not tiers.samples():
        return
    kept = items if tiers.tier() == "sampled" else \
        [item for item in items if item.get_closest_marker("full") is None]
    kept = tiers.sampled(kept)
    if len(kept) < len(items):
        chosen = set(map(id, kept))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in chosen])
        items[:] = kept
