"""``moe frameworks``: every framework's MoE path (NumPy, torch, JAX under
jit, CuPy where CUDA is) on the same problem, against the bare exchange of
its bytes."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import click
import numpy as np
from mpi4py import MPI

import commlib
from commlib import moe
from commlib.tools.bench.moe.baselines import there_and_back
from commlib.tools.bench.timing import interleaved, json_option, write_json


def _framework_paths(comm, num_experts: int, x: np.ndarray, experts: np.ndarray,
                     weights: np.ndarray) -> Tuple[Dict[str, Any], int]:
    """The MoE path of every framework here, each a dispatch + combine of
    the same rows with identity experts (the Dispatcher's defaults) and its
    result as NumPy, and the rows of the JAX layout's send buffer: the core on
    NumPy arrays, the torch Dispatcher (autograd functions over the core),
    the JAX Dispatcher under ``jax.jit`` (its own padded layout), and the
    core on CuPy arrays where CUDA is."""
    paths: Dict[str, Any] = {}
    numpy_d = moe.Dispatcher(comm, num_experts)
    paths["NumPy core"] = (lambda: numpy_d.combine(*numpy_d.dispatch(x, experts, weights)),
                           lambda y: y)
    import torch

    from commlib.bindings.torch import Dispatcher as TorchDispatcher
    torch.set_num_threads(1)
    torch_d = TorchDispatcher(comm, num_experts)
    tx, te, tw = (torch.from_numpy(a) for a in (x, experts, weights))
    paths["torch Dispatcher"] = (lambda: torch_d.combine(*torch_d.dispatch(tx, te, tw)),
                                 lambda y: y.numpy())
    import jax
    import jax.numpy as jnp

    from commlib.bindings.jax import Dispatcher as JaxDispatcher
    jax_d = JaxDispatcher(comm, num_experts)
    jx, je, jw = jnp.asarray(x), jnp.asarray(experts.astype(np.int32)), jnp.asarray(weights)
    jax_pair = jax.jit(lambda x, e, w: jax_d.combine(*jax_d.dispatch(x, e, w)))
    paths["JAX Dispatcher (jit)"] = (lambda: jax_pair(jx, je, jw).block_until_ready(),
                                     np.asarray)
    cupy = _cupy()
    if cupy is not None:
        cupy_d = moe.Dispatcher(comm, num_experts)
        cx, ce, cw = (cupy.asarray(a) for a in (x, experts, weights))

        def cupy_pair():
            y = cupy_d.combine(*cupy_d.dispatch(cx, ce, cw))
            cupy.cuda.get_current_stream().synchronize()
            return y
        paths["CuPy core"] = (cupy_pair, cupy.asnumpy)
    return paths, num_experts * jax_d.capacity(*experts.shape)


def _cupy() -> Any:
    """CuPy where it imports and sees a CUDA device, else None."""
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, or no driver: no CuPy line
        return None


@click.command()
@click.option("--tokens", default=4096, show_default=True, help="Tokens per rank.")
@click.option("--hidden", default=1024, show_default=True)
@click.option("--experts", "num_experts", default=8, show_default=True)
@click.option("--topk", default=2, show_default=True)
@click.option("--iters", default=15, show_default=True)
@json_option
def frameworks(tokens: int, hidden: int, num_experts: int, topk: int, iters: int,
               json_path: Optional[str]) -> None:
    """One line per framework's MoE path (NumPy core, torch Dispatcher, JAX
    Dispatcher under jit, CuPy core where CUDA is) for the same float32
    rows and routing, identity experts, each against the bare mpi4py
    exchange of the counted dispatch's bytes (count exchange, ``Alltoallv``
    of the rows with their ids and weights there, of the rows back),
    interleaved in one launch: a change that speeds one path is measured in
    all. The JAX Dispatcher moves its padded layout (every expert's
    ``capacity`` slots from every rank); its line also gives the ratio to a
    bare ``Alltoall`` of those bytes there and back."""
    world = MPI.COMM_WORLD
    comm = commlib.init(backend="mpi", abort_on_error=True)
    raw = world.Dup()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    experts, weights = moe.route(rng.standard_normal((tokens, num_experts)), topk)
    weights = weights.astype(np.float32)
    paths, padded_rows = _framework_paths(comm, num_experts, x, experts, weights)
    reference = paths["NumPy core"][0]()
    for name, (run, as_numpy) in paths.items():
        if not np.allclose(as_numpy(run()), reference, atol=1e-5):
            raise AssertionError(f"{name} disagrees with the NumPy core")
    _, handle = moe.Dispatcher(comm, num_experts).dispatch(x, experts, weights)
    there = np.asarray(handle.route.send_counts, np.int64)
    row_bytes = hidden * 4 + 8 * topk
    counted = there_and_back(raw, np.zeros((int(there.sum()), row_bytes), np.uint8), there,
                             back_bytes=hidden * 4)
    padded = np.zeros((padded_rows, hidden * 4), np.uint8)
    padded_back = np.empty_like(padded)

    def padded_exchange() -> None:
        raw.Alltoall(padded, padded_back)
        raw.Alltoall(padded_back, padded)
    contenders = {"mpi4py bare exchange": counted, "mpi4py bare Alltoall (padded)":
                  padded_exchange}
    contenders.update({name: run for name, (run, _) in paths.items()})
    times = {name: float(np.median(t))
             for name, t in interleaved(world, contenders, iters).items()}
    sent = {"counted": int(there.sum()) * row_bytes, "padded": padded.nbytes}
    say(f"bench_moe frameworks: {comm.size} ranks; {tokens} tokens x {hidden} float32 per "
        f"rank, {num_experts} experts, top-{topk}, no capacity factor; identity experts; "
        f"dispatch + combine, median of {iters}, slowest rank; sent per rank on dispatch: "
        f"{sent['counted'] / 2**20:.1f} MiB deduplicated, {sent['padded'] / 2**20:.1f} MiB "
        f"padded (JAX)")
    bare, bare_padded = times["mpi4py bare exchange"], times["mpi4py bare Alltoall (padded)"]
    rows = []
    for name, seconds in times.items():
        row = {"contender": name, "seconds": seconds, "ratio_to_bare": seconds / bare}
        note = ""
        if name.startswith("JAX"):
            row["ratio_to_bare_padded"] = seconds / bare_padded
            note = f", {seconds / bare_padded:.2f}x the padded Alltoall"
        rows.append(row)
        say(f"{name:>30}: {seconds * 1e3:8.1f} ms ({seconds / bare:.2f}x bare{note})",
            flush=True)
    write_json(json_path, rows, comm.rank)
    raw.Free()
    comm.free()
