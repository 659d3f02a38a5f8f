"""What the bindings cost: ring attention forward + backward through
``commlib.bindings.torch`` (autograd) and ``commlib.bindings.jax`` (a jitted
``jax.grad``) against the commlib core called directly, outside any autograd
or jit, on the same arrays in each binding's framework, interleaved in one
launch.

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        mpiexec -bind-to core -n 2 python -m commlib.tools.bench.bindings
"""

from __future__ import annotations

import time

import click
import numpy as np
import torch
from mpi4py import MPI

import commlib
from commlib import ring
from commlib.bindings import torch as ct


@click.command()
@click.option("--seq", default=4096, show_default=True, help="Global sequence length.")
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--repeats", default=5, show_default=True)
def main(seq: int, heads: int, head_dim: int, repeats: int) -> None:
    """Binding overhead of torch ring attention, forward + backward."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    gen = torch.Generator().manual_seed(comm.rank)
    shape = (1, seq // comm.size, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, generator=gen) for _ in range(4))

    def through_torch():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ct.ring_attention(*leaves, comm, causal=True, layout="zigzag").backward(dout)

    import jax
    import jax.numpy as jnp

    from commlib.bindings import jax as cj

    jq, jk, jv, jdout = (jnp.asarray(t.numpy()) for t in (q, k, v, dout))
    jax_step = jax.jit(jax.grad(
        lambda q, k, v: (cj.ring_attention(q, k, v, comm, layout="zigzag", causal=True)
                         * jdout).sum(),
        argnums=(0, 1, 2)))
    jax.block_until_ready(jax_step(jq, jk, jv))  # compile outside the timing

    def through_jax():
        jax.block_until_ready(jax_step(jq, jk, jv))

    def core_on(arrays):
        def call():
            out, lse = ring.ring_attention(*arrays[:3], comm, layout="zigzag", causal=True,
                                           return_lse=True)
            ring.ring_attention_backward(arrays[3], *arrays[:3], out, lse, comm,
                                         layout="zigzag", causal=True)
        return call

    # each binding against the core called directly in its own framework,
    # interleaved pair by pair: XLA's runtime thread stays busy for a while
    # after a JAX call and slowed whichever torch call came next (measured:
    # the torch binding 1.11-1.13x its core when it followed JAX, 1.00x alone)
    pairs = [{"torch binding": through_torch, "core on torch tensors": core_on([q, k, v, dout])},
             {"jax binding (jit)": through_jax,
              "core on jax arrays": core_on([jq, jk, jv, jdout])}]
    times = {name: [] for pair in pairs for name in pair}
    for pair in pairs:
        for _ in range(repeats):
            for name, call in pair.items():
                world.Barrier()
                start = time.perf_counter()
                call()
                times[name].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    median = {name: float(np.median(t)) for name, t in times.items()}
    if comm.rank == 0:
        print(f"bench_bindings: {comm.size} ranks, seq {seq}, heads {heads}, head_dim "
              f"{head_dim}, causal zigzag ring, forward + backward")
        for name, core, target in (("torch binding", "core on torch tensors", 1.10),
                                   ("jax binding (jit)", "core on jax arrays", 1.20)):
            print(f"{name} {median[name] * 1e3:.1f} ms, {core} {median[core] * 1e3:.1f} ms, "
                  f"ratio {median[name] / median[core]:.3f} (target <= {target:.2f})")
    comm.free()


if __name__ == "__main__":
    main()
