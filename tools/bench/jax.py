"""The JAX binding against its alternatives: ring attention forward +
backward as one jitted ``jax.value_and_grad`` against the torch binding on
the same shapes and cores (interleaved in one launch), and the cost of one
jitted ring shift against the raw commlib call on NumPy.

    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false OPENBLAS_NUM_THREADS=1 \\
        mpiexec -bind-to core -n 2 python -m commlib.tools.bench.jax
    python -m commlib.tools.bench.jax --alone   # jax.nn.dot_product_attention, one process

``-bind-to core`` matters: XLA's CPU runtime runs a second thread whatever
its flags say, so two unbound ranks put four threads on two cores (measured:
the jnp kernel 1.9x slower, torch's unchanged). ``--alone`` times XLA's own
attention on the whole sequence in one process on every core: the user's
real alternative.
"""

from __future__ import annotations

import time

import click
import numpy as np


def _median_s(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _alone(seq: int, heads: int, head_dim: int, repeats: int) -> None:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    q, k, v, probe = (jnp.asarray(rng.standard_normal((1, seq, heads, head_dim), np.float32))
                      for _ in range(4))
    step = jax.jit(jax.value_and_grad(
        lambda q, k, v: (jax.nn.dot_product_attention(q, k, v, is_causal=True) * probe).sum(),
        argnums=(0, 1, 2)))
    jax.block_until_ready(step(q, k, v))
    seconds = _median_s(lambda: jax.block_until_ready(step(q, k, v)), repeats)
    print(f"jax.nn.dot_product_attention, one process, seq {seq}: {seconds:.3f} s")


@click.command()
@click.option("--seq", default=8192, show_default=True, help="Global sequence length.")
@click.option("--heads", default=8, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--alone", is_flag=True, help="Only XLA's attention in this one process.")
def main(seq: int, heads: int, head_dim: int, repeats: int, alone: bool) -> None:
    """JAX ring attention (jit, grad) vs the torch binding; a jitted shift vs raw."""
    if alone:
        _alone(seq, heads, head_dim, repeats)
        return
    import jax
    import jax.numpy as jnp
    import torch

    import commlib
    from commlib.bindings import jax as cj
    from commlib.bindings import torch as ct
    from commlib.bindings.jax import traced

    torch.set_num_threads(1)
    comm = commlib.init(backend="mpi", abort_on_error=True)
    rng = np.random.default_rng(comm.rank)
    shape = (1, seq // comm.size, heads, head_dim)
    host = [rng.standard_normal(shape, np.float32) for _ in range(4)]

    jq, jk, jv, jprobe = (jnp.asarray(a) for a in host)
    jax_step = jax.jit(jax.value_and_grad(
        lambda q, k, v: (cj.ring_attention(q, k, v, comm, layout="zigzag", causal=True)
                         * jprobe).sum(),
        argnums=(0, 1, 2)))
    jax.block_until_ready(jax_step(jq, jk, jv))  # compile outside the timing

    tq, tk, tv, tprobe = (torch.from_numpy(a) for a in host)

    def torch_step():
        leaves = [t.clone().requires_grad_() for t in (tq, tk, tv)]
        (ct.ring_attention(*leaves, comm, causal=True, layout="zigzag") * tprobe).sum() \
            .backward()

    contenders = {"jax binding (jit, value_and_grad)":
                  lambda: jax.block_until_ready(jax_step(jq, jk, jv)),
                  "torch binding (autograd)": torch_step}
    times = {name: [] for name in contenders}
    for _ in range(repeats):  # interleaved: the machine's noise hits both
        for name, call in contenders.items():
            comm.barrier()
            times[name].append(_median_s(call, 1))
    medians = {name: float(np.median(t)) for name, t in times.items()}

    tc = traced(comm)
    small = np.arange(256, dtype=np.float32)  # 1 KiB

    def rotate(x):
        with tc.ordered():
            return tc.ring_shift(x)
    jitted_shift = jax.jit(rotate)
    jsmall = jnp.asarray(small)
    jax.block_until_ready(jitted_shift(jsmall))
    shift_us = {}
    for name, call in {"raw commlib ring_shift (NumPy)": lambda: comm.ring_shift(small),
                       "jitted ring shift (buffer_callback)":
                       lambda: jax.block_until_ready(jitted_shift(jsmall))}.items():
        comm.barrier()
        shift_us[name] = 1e6 * _median_s(call, 200)
    if comm.rank == 0:
        torch_s = medians["torch binding (autograd)"]
        print(f"ring attention fwd+bwd, {comm.size} ranks, seq {seq}, {heads} heads, "
              f"d {head_dim}, causal zigzag, float32")
        for name, seconds in medians.items():
            print(f"  {name:40s} {seconds:8.3f} s  ({seconds / torch_s:.2f}x torch)")
        raw = shift_us["raw commlib ring_shift (NumPy)"]
        print("one 1 KiB ring shift")
        for name, us in shift_us.items():
            print(f"  {name:40s} {us:8.1f} us ({us / raw:.2f}x raw)")
    comm.free()


if __name__ == "__main__":
    main()
