"""Rank 1 fails while the launcher's output forwarder on its node (its
parent: MPICH's hydra_pmi_proxy, Open MPI's prted) is stopped for half a
second, so that the forwarder wakes to find the report and the abort both
waiting: the report must still reach mpiexec's output."""
import os
import signal
import subprocess

import numpy as np

import commlib

comm = commlib.init(abort_on_error=True)
comm.barrier()
if comm.rank == 1:
    forwarder = os.getppid()
    subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -CONT {forwarder}"], start_new_session=True)
    try:
        os.kill(forwarder, signal.SIGSTOP)
    except PermissionError:
        print(f"rank 1: the launcher's forwarder (pid {forwarder}) cannot be stopped; "
              f"failing with it running", flush=True)
    raise RuntimeError("deliberate failure on rank 1")
comm.allreduce(np.ones(4))
