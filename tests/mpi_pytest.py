"""Run pytest on one rank of an mpiexec launch, its report in a file.

    mpiexec -n 3 python tests/mpi_pytest.py LOGDIR [pytest args]

Each rank writes LOGDIR/rank<r>.log and exits with pytest's status, so the
launcher can show which rank failed and why without interleaved output, and
LOGDIR/rank<r>.xml (junit), so that it can tell what ran and what skipped
(tests/rank_outcomes.py). A rank whose tests failed aborts the job after a
short grace: its peers may be waiting in a collective it will never make.
"""

import os
import sys
import time

import pytest
from mpi4py import MPI


def main() -> int:
    logdir, args = sys.argv[1], sys.argv[2:]
    rank = MPI.COMM_WORLD.Get_rank()
    os.environ["COMMLIB_TEST_UNDER_MPIEXEC"] = "1"
    with open(os.path.join(logdir, f"rank{rank}.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        junit = os.path.join(logdir, f"rank{rank}.xml")
        status = int(pytest.main(["-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *args]))
        log.flush()
    if status != 0:
        time.sleep(3)  # let peers that are not stuck finish their reports
        MPI.COMM_WORLD.Abort(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
