"""Rank 1 raises an uncaught exception while the others wait in a
collective: with abort_on_error the whole job ends, non-zero."""
import numpy as np

import commlib

comm = commlib.init(abort_on_error=True)
comm.barrier()
if comm.rank == 1:
    raise RuntimeError("deliberate failure on rank 1")
comm.allreduce(np.ones(4))
