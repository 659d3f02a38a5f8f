"""Ranks disagree on a shape under COMMLIB_CHECK=1: every rank raises
CollectiveMismatchError naming the ranks, and the job goes on."""
import numpy as np

import commlib

comm = commlib.init(check=True)
try:
    comm.allreduce(np.ones(4 + (comm.rank == 1)))
except commlib.CollectiveMismatchError as error:
    print(f"rank {comm.rank}: CollectiveMismatchError: {error}", flush=True)
comm.barrier()
comm.free()
