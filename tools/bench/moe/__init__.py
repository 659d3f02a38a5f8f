"""MoE dispatch + combine on this machine, every timing against a baseline
run in the same launch, interleaved, the slowest rank's time per iteration,
the median reported.

    mpiexec -n 4 python -m commlib.tools.bench.moe throughput --ranks-per-node 2
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe modes
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe latency
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe decode
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe overlap
    mpiexec -bind-to core -n 2 python -m commlib.tools.bench.moe frameworks

``throughput``: commlib (flat, two-hop) against a hand-written mpi4py
dispatcher that sends every token-expert pair (the Megatron-style path),
identity experts. ``modes``: FP8 against the input dtype, the fixed capacity
against the counted dispatch (DeepSeek-V3's 7168 hidden, top-8 of 64, torch
bfloat16). ``latency``: the fixed cost of ``alltoall``/``alltoallv`` against
mpi4py's ``Alltoall`` and count exchange + ``Alltoallv``. ``decode``: a
dispatch + combine pair of 1 to 512 tokens, counted and fixed, torch and
NumPy, against the bare mpi4py exchange of the same bytes. ``overlap``:
two micro-batches with an expert MLP between dispatch and combine,
sequential against overlapped with the async handles: how much of the
communication the overlap hides.
``frameworks``: one line per framework's MoE path (NumPy, torch, JAX under
jit, CuPy where CUDA is) for the same problem, against the bare mpi4py
exchange of the same bytes.

One module a benchmark, named as its command; what several time against,
written by hand (mpi4py, torch), is ``baselines.py``; the torch rows, routing
and commlib pair several time, ``workload.py``.
"""

from __future__ import annotations

import click

from commlib.tools.bench.moe import decode, frameworks, latency, modes, overlap, throughput


@click.group()
def main() -> None:
    """MoE benchmarks (see the module docstring)."""


main.add_command(throughput.throughput)
main.add_command(modes.modes)
main.add_command(frameworks.frameworks)
main.add_command(latency.latency)
main.add_command(decode.decode)
main.add_command(overlap.overlap)
