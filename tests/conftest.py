"""Multi-rank tests live in tests/mpi/ and run under mpiexec, launched by
tests/test_multirank.py; a plain ``pytest`` collects them only there."""

import os

if os.environ.get("COMMLIB_TEST_UNDER_MPIEXEC") != "1":
    collect_ignore = ["mpi"]
