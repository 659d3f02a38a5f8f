"""Rank 1 is killed with SIGKILL in the middle of a stream of alltoallv
calls: the job must end (the launcher's cleanup, or the others' deadline)."""
import os
import signal

import numpy as np

import commlib

comm = commlib.init(abort_on_error=True)
x = np.ones((comm.size * 1024, 256), np.float32)
for step in range(1000):
    if comm.rank == 1 and step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.alltoallv(x, [1024] * comm.size)
