# mpiexec -n 3 python examples/moe_shuffle.py
import numpy as np
import torch

import commlib

comm = commlib.init()                        # a duplicate of MPI.COMM_WORLD
rank, size = comm.rank, comm.size
send_counts = np.array([rank + 1] * size)    # rank r sends r+1 rows to every rank
tokens = torch.full((int(send_counts.sum()), 4), float(rank))
received, recv_counts = comm.alltoallv(tokens, send_counts)  # torch in, torch out
total = comm.allreduce(torch.tensor([received.shape[0]]))
print(f"rank {rank}: got {type(received).__name__} {tuple(received.shape)}, "
      f"rows per sender {recv_counts.tolist()}, first column {received[:, 0].tolist()}, "
      f"rows everywhere {total.item()}")
