# mpiexec -n 2 python examples/moe_overlap.py
# Two micro-batches through an MoE layer, DualPipe's pairing: B's dispatch is
# in flight while A's experts compute, A's combine while B's do. FP8 rows, a
# fixed capacity (nothing read back from the device), torch autograd.
import torch

import commlib
from commlib import moe
from commlib.bindings.torch import Dispatcher

comm = commlib.init()
E, K, T, H = 8 * comm.size, 2, 64, 256      # experts, top-k, tokens per micro-batch, hidden
local = E // comm.size
torch.manual_seed(comm.rank)
w = torch.randn(local, H, H) / H ** 0.5     # this rank's experts
w.requires_grad_()
d = Dispatcher(comm, E, max_tokens_per_rank=T)


def batch():
    x = torch.randn(T, H, requires_grad=True)
    experts, weights = moe.route(torch.randn(T, E), K)
    return x, experts, weights


def experts_of(expert_x):                   # [local experts, slots, H]: padding included
    return torch.bmm(expert_x, w)


a, b = batch(), batch()
started = [d.dispatch_async(*a, quantize="fp8", dequantize=True),
           d.dispatch_async(*b, quantize="fp8", dequantize=True)]
xa, ha = started[0].wait()
ya = d.combine_async(experts_of(xa), ha)    # B's dispatch is in flight meanwhile
xb, hb = started[1].wait()
yb = d.combine_async(experts_of(xb), hb)    # A's combine is in flight meanwhile
loss = ya.wait().square().sum() + yb.wait().square().sum()
loss.backward()
stats = d.collect_stats()                   # collective: the counts reach the host here
print(f"rank {comm.rank}: loss {loss.item():.1f}, |dx_a| {a[0].grad.norm():.2f}, "
      f"|dw| {w.grad.norm():.2f}, assignments {stats.tokens_per_expert.sum()}, "
      f"dropped {stats.dropped.sum()}, payload {stats.traffic.sum()} B")
