"""Rank 0 calls allreduce while the others call barrier. MPI itself may
match the two (MPICH does, silently); under COMMLIB_CHECK=1 every rank
raises CollectiveMismatchError saying who called what."""
import numpy as np

import commlib

comm = commlib.init(check=True)
try:
    if comm.rank == 0:
        comm.allreduce(np.ones(2))
    else:
        comm.barrier()
except commlib.CollectiveMismatchError as error:
    print(f"rank {comm.rank}: CollectiveMismatchError: {error}", flush=True)
comm.barrier()
comm.free()
