"""Multi-rank tests live in tests/mpi/ and run under mpiexec, launched by
tests/test_multirank.py; a plain ``pytest`` collects them only there. What
each launch ran is printed at the end (tests/rank_outcomes.py)."""

import os

from rank_outcomes import SUMMARY_KEY

if os.environ.get("COMMLIB_TEST_UNDER_MPIEXEC") != "1":
    collect_ignore = ["mpi"]


def pytest_terminal_summary(terminalreporter, config):
    """Passed, failed and skipped (by allowed reason) at each multi-rank launch."""
    lines = config.stash.get(SUMMARY_KEY, [])
    if lines:
        terminalreporter.write_sep("-", "multi-rank launches: what each rank ran")
        for line in lines:
            terminalreporter.write_line(line)
