# mpiexec -n 2 python examples/jax_ulysses.py
import jax
import jax.numpy as jnp
import numpy as np

import commlib
from commlib import ring
from commlib.bindings import jax as cj

comm = commlib.init()
q, k, v = (np.random.default_rng(i).standard_normal((1, 64, 4, 16), np.float32) for i in range(3))
mine = [jnp.asarray(ring.shard_sequence(t, comm, layout="contiguous")) for t in (q, k, v)]
step = jax.jit(jax.value_and_grad(lambda q, k, v: jnp.square(
    cj.ulysses_attention(q, k, v, comm, layout="contiguous", causal=True)).sum()))
loss, dq = step(*mine)                               # jit-ed, differentiable, Ulysses inside
total = comm.allreduce(np.array([float(loss)]))[0]
full = jax.nn.dot_product_attention(q, k, v, is_causal=True)
unsharded = float(jnp.square(full).sum())
print(f"rank {comm.rank}: dq {dq.shape}, loss {total:.4f} vs unsharded {unsharded:.4f}")
