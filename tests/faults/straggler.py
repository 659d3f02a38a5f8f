"""Rank 1 never arrives at the allreduce (it sleeps); the others must end
with CommTimeoutError / PeerFailedError naming it, and the job must end."""
import sys
import time

import numpy as np

import commlib

comm = commlib.init(abort_on_error=True)
comm.barrier()
if comm.rank == 1:
    time.sleep(120)
try:
    comm.allreduce(np.ones(4))
except commlib.CommlibError as error:
    print(f"rank {comm.rank}: {type(error).__name__}: {error}", flush=True)
    raise
sys.exit(0)
