# mpiexec -n 2 python examples/torch_ring.py
import torch

import commlib
from commlib import ring
from commlib.bindings import torch as ct

comm = commlib.init()
torch.manual_seed(0)  # the same global tensors on every rank
q, k, v = (torch.randn(1, 64, 4, 16) for _ in range(3))
mine = [ring.shard_sequence(t, comm, layout="zigzag").requires_grad_() for t in (q, k, v)]
out = ct.ring_attention(*mine, comm, causal=True, layout="zigzag")
out.square().sum().backward()                      # gradients through the ring
full = torch.nn.functional.scaled_dot_product_attention(
    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
error = (ring.unshard_sequence(out.detach(), comm, layout="zigzag") - full).abs().max()
print(f"rank {comm.rank}: out {tuple(out.shape)}, dq {tuple(mine[0].grad.shape)}, "
      f"max |out - full attention| {error:.1e}", flush=True)
