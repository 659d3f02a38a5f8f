"""Every collective on every framework's arrays (NumPy, torch, JAX on the
host; CuPy, torch CUDA and JAX on a GPU, marked ``gpu``) in float32,
float16, bfloat16 and int32, against NumPy computed on every rank from every
rank's seeded input (``collective_checks``): bit-exact where bytes only
move, sums within their rounding; results in the caller's framework, device
and dtype; inputs untouched.

On a machine with one GPU and several ranks, ``commlib.init()`` falls back to
MPI, so the GPU cases run the staged path (CUDA buffers through host
memory); with a GPU per rank (or at one rank) they run NCCL.
"""

import pytest

import requires
from collective_checks import CHECKS, cases
from conftest import all_ranks

# the framework round trip is the same at any size past 1
WORLD_SIZES = (2, 3)

requires.module("torch")
requires.module("jax")


@pytest.mark.quick_sample(40)
@pytest.mark.parametrize("collective", list(CHECKS))
@pytest.mark.parametrize("impl, dtype", cases())
def test_collective_matches_numpy(comm, impl, dtype, collective):
    failures = CHECKS[collective](comm, impl, dtype)
    assert all_ranks(not failures), "\n".join(failures)
