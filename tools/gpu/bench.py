"""The timings a GPU session owes, in one JSON file (``tools/gpu_check.sh``
runs it); ``--device cpu --quick`` runs the same code on a CPU as a smoke
test.

    python -m commlib.tools.gpu.bench --out gpu_check.json

One process (a world of one; NCCL is a size-1 communicator there), torch
arrays on ``--device``, every time taken after a warm-up, with the device
synchronized around it, best of ``--repeats``:

- alltoallv: GB/s of ``comm.alltoallv`` at 1 MiB, 64 MiB and 1 GiB against a
  device copy of the same bytes (``Tensor.clone``);
- the ring block kernel: TFLOP/s of ``commlib.kernels.kernel_for(q)``
  forward + backward against torch SDPA (which picks flash on an H100/H200)
  on the same shapes: batch 1, seq 8192, 32 heads, 8 kv heads, head_dim 128,
  bfloat16, causal;
- ring attention forward + backward through ``commlib.bindings.torch``
  against SDPA on those shapes;
- MoE dispatch + combine: 8192 tokens x 4096 bfloat16, 64 experts, top-8;
- the JAX binding on JAX's device: ring attention forward + backward under
  ``jit`` against ``jax.nn.dot_product_attention`` (cuDNN on a GPU) on the
  attention shapes, and a jitted MoE dispatch + combine with gradients
  (capacity factor 1.25) on the MoE shapes;
- CUDA arrays over MPI (``backends.staged``, what a communicator without
  NCCL uses): which path this MPI gets (cuda-aware or staged, and why), and
  GB/s of a send-receive to this same rank at the alltoallv sizes. In a
  world of one that is the whole pipeline but the network: chunks copied to
  pinned memory, handed to MPI, copied back, overlapped (staged), or device
  buffers handed to MPI (cuda-aware). On ``--device cpu`` NumPy copies
  stand in for the device.
"""

from __future__ import annotations

import functools
import json
from typing import Callable, Dict

import click
import torch

import commlib
from commlib import moe
from commlib.bindings import torch as ct
from commlib.kernels import kernel_for
from commlib.tools.bench.timing import best_local

FULL = dict(seq=8192, heads=32, kv_heads=8, head_dim=128, tokens=8192, hidden=4096,
            experts=64, topk=8, sizes=(2**20, 2**26, 2**30))
QUICK = dict(seq=256, heads=4, kv_heads=2, head_dim=32, tokens=256, hidden=64,
             experts=8, topk=2, sizes=(2**16, 2**20))


def _best(call: Callable[[], object], device: str, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls, after one warm-up."""
    call()
    return best_local(call, repeats, torch.cuda.synchronize if device == "cuda" else lambda: None)


def _alltoallv(comm, device: str, sizes, repeats: int) -> Dict[str, dict]:
    rows = {}
    for nbytes in sizes:
        x = torch.empty(nbytes, dtype=torch.uint8, device=device)
        counts = [nbytes]
        t_comm = _best(functools.partial(comm.alltoallv, x, counts, counts), device, repeats)
        t_copy = _best(x.clone, device, repeats)
        rows[f"{nbytes}"] = {"alltoallv_GBps": nbytes / t_comm / 1e9,
                             "device_copy_GBps": 2 * nbytes / t_copy / 1e9,
                             "alltoallv_s": t_comm, "copy_s": t_copy}
    return rows


def _staged_mpi(comm, device: str, sizes, repeats: int) -> dict:
    from commlib.backends.cuda_aware import detect
    from commlib.backends.staged import HostCopies, StagedBackend
    if device == "cuda":
        import cupy
        backend, view = StagedBackend(comm._host), cupy.from_dlpack
    else:
        backend = StagedBackend(comm._host, device=HostCopies(), cuda_aware=False)
        view = torch.Tensor.numpy

    def shift(x, out):
        backend.start_sendrecv(x, comm.rank, out, comm.rank)()

    rows = {}
    for nbytes in sizes:
        x, out = (view(torch.empty(nbytes, dtype=torch.uint8, device=device)) for _ in range(2))
        t = _best(functools.partial(shift, x, out), device, repeats)
        rows[f"{nbytes}"] = {"sendrecv_self_GBps": nbytes / t / 1e9, "sendrecv_self_s": t}
    aware = detect()
    return {"path": backend.path, "reason": backend.reason, "chunk_bytes": backend.chunk_bytes,
            "mpi_cuda_aware": {"aware": aware.aware, "reason": aware.reason},
            "sendrecv_self": rows}


def _attention(comm, device: str, shape: dict, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    b, s, h, hk, d = 1, shape["seq"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    q, dout = (torch.randn(b, s, h, d, generator=gen, device=device).bfloat16()
               for _ in range(2))
    k, v = (torch.randn(b, s, hk, d, generator=gen, device=device).bfloat16() for _ in range(2))
    kernel, scale = kernel_for(q), d ** -0.5

    def block():
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(dout, q, k, v, out, lse, True, scale)

    def sdpa():
        leaves = [t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(
            *leaves, is_causal=True, enable_gqa=True).backward(dout.transpose(1, 2))

    def ring():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        ct.ring_attention(*leaves, comm, causal=True, layout="zigzag").backward(dout)

    flops = 3.5 * 2 * 2 * b * h * s * s * d / 2  # causal: forward 4bhs^2d/2, backward 2.5x
    t_block, t_sdpa, t_ring = (_best(f, device, repeats) for f in (block, sdpa, ring))
    return {"shape": dict(batch=b, seq=s, heads=h, kv_heads=hk, head_dim=d, dtype="bfloat16",
                          causal=True),
            "kernel": kernel.name, "kernel_TFLOPs": flops / t_block / 1e12,
            "sdpa_TFLOPs": flops / t_sdpa / 1e12, "kernel_s": t_block, "sdpa_s": t_sdpa,
            "ring_s": t_ring, "ring_over_sdpa": t_ring / t_sdpa}


def _moe(comm, device: str, shape: dict, repeats: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    tokens, hidden, experts = shape["tokens"], shape["hidden"], shape["experts"]
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    chosen, weights = moe.route(logits, shape["topk"])
    dispatcher = moe.Dispatcher(comm, experts)

    def step():
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        dispatcher.combine(expert_x, handle)
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": shape["topk"],
            "dtype": "bfloat16", "dispatch_combine_s": _best(step, device, repeats)}


def _jax_attention(comm, device: str, shape: dict, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from commlib.bindings import jax as cj

    place = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    b, s, h, hk, d = 1, shape["seq"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, probe = (jax.device_put(jax.random.normal(key, (b, s, heads, d), jnp.bfloat16),
                                     place) for key, heads in zip(keys, (h, hk, hk, h)))
    implementation = "cudnn" if device == "cuda" else None

    def step(attend):
        loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * probe).sum()  # noqa: E731
        jitted = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(jitted(q, k, v))
    ring = step(lambda q, k, v: cj.ring_attention(q, k, v, comm, layout="zigzag", causal=True))
    alone = step(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation))
    t_ring, t_alone = (_best(call, device, repeats) for call in (ring, alone))
    return {"shape": dict(batch=b, seq=s, heads=h, kv_heads=hk, head_dim=d, dtype="bfloat16",
                          causal=True),
            "alone": f"jax.nn.dot_product_attention ({implementation or 'xla'})",
            "ring_s": t_ring, "alone_s": t_alone, "ring_over_alone": t_ring / t_alone}


def _jax_moe(comm, device: str, shape: dict, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from commlib.bindings import jax as cj

    place = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    tokens, hidden = shape["tokens"], shape["hidden"]
    experts, topk = shape["experts"], shape["topk"]
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.device_put(jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16), place)
    logits = jax.device_put(jax.random.normal(keys[1], (tokens, experts)), place)
    dispatcher = cj.Dispatcher(comm, experts, capacity_factor=1.25)

    def loss(x, logits):
        weights, chosen = jax.lax.top_k(jax.nn.softmax(logits), topk)
        expert_x, handle = dispatcher.dispatch(x, chosen, weights)
        return dispatcher.combine(expert_x, handle).astype(jnp.float32).sum()
    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return {"tokens": tokens, "hidden": hidden, "experts": experts, "topk": topk,
            "dtype": "bfloat16", "capacity_factor": 1.25,
            "dispatch_combine_grad_s": _best(lambda: jax.block_until_ready(step(x, logits)),
                                             device, repeats)}


@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--quick", is_flag=True, help="Tiny shapes: a smoke test, not a measurement.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Write the results as JSON here (they are printed too).")
def main(device: str, quick: bool, repeats: int, out_path) -> None:
    """Time alltoallv, the attention block kernel, the ring and MoE on one device."""
    comm = commlib.init()
    shape = QUICK if quick else FULL
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "backend": comm.backend, "torch": torch.__version__, "quick": quick}
    for name, measure in (("alltoallv", lambda: _alltoallv(comm, device, shape["sizes"], repeats)),
                          ("staged_mpi", lambda: _staged_mpi(comm, device, shape["sizes"],
                                                             repeats)),
                          ("attention", lambda: _attention(comm, device, shape, repeats)),
                          ("moe", lambda: _moe(comm, device, shape, repeats)),
                          ("jax_attention", lambda: _jax_attention(comm, device, shape,
                                                                   repeats)),
                          ("jax_moe", lambda: _jax_moe(comm, device, shape, repeats))):
        try:  # one failing part must not cost the others' numbers on a lent machine
            results[name] = measure()
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"}
    text = json.dumps(results, indent=1)
    print(text)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    comm.free()


if __name__ == "__main__":
    main()
