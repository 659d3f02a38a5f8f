"""Collectives take PyTorch and JAX arrays and give back the same framework,
with the same values as the NumPy path."""

import ml_dtypes
import numpy as np
import pytest

import requires
from conftest import all_ranks, reference_alltoallv

# collectives' framework round trip: one size past 1 shows it
WORLD_SIZES = (2,)

torch = requires.module("torch")
jnp = requires.module("jax.numpy")


def _send_counts(comm):
    return np.array([(comm.rank + peer) % 3 + 1 for peer in range(comm.size)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool,
                                   torch.float16, torch.float8_e4m3fn])
def test_torch_in_torch_out(comm, dtype):
    send = _send_counts(comm)
    x = (torch.arange(int(send.sum()) * 2).reshape(-1, 2) % 7 + comm.rank).to(dtype)
    y, _ = comm.alltoallv(x, send)
    assert isinstance(y, torch.Tensor) and y.dtype == dtype
    as_numpy = x.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).numpy() \
        if dtype in (torch.bfloat16, torch.float8_e4m3fn) else x.numpy()
    expected = reference_alltoallv(as_numpy, send)
    got = y.view(torch.uint8 if dtype.itemsize == 1 else torch.int16).numpy() \
        if dtype in (torch.bfloat16, torch.float8_e4m3fn) else y.numpy()
    assert all_ranks(np.array_equal(got, expected))


def test_torch_non_contiguous_and_requires_grad(comm):
    base = torch.arange(comm.size * 6, dtype=torch.float32).reshape(comm.size * 2, 3)
    x = (base + comm.rank).t().contiguous().t().requires_grad_(True)  # column-major view
    y = comm.allgather(x)
    expected = torch.cat([base + r for r in range(comm.size)])
    assert all_ranks(torch.equal(y, expected) and not y.requires_grad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_jax_in_jax_out(comm, dtype):
    import jax

    send = _send_counts(comm)
    x = (jnp.arange(int(send.sum()) * 2).reshape(-1, 2) % 7 + comm.rank).astype(dtype)
    y, _ = comm.alltoallv(x, send)
    assert isinstance(y, jax.Array) and y.dtype == dtype
    expected = reference_alltoallv(np.asarray(x), send)
    assert all_ranks(np.asarray(y).tobytes() == expected.tobytes())


def test_bfloat16_allreduce_torch_and_jax(comm):
    t = comm.allreduce(torch.full((3,), 1.5, dtype=torch.bfloat16))
    j = comm.allreduce(jnp.full((3,), 1.5, dtype=jnp.bfloat16))
    assert t.dtype == torch.bfloat16 and j.dtype == jnp.bfloat16
    assert all_ranks(t.float().tolist() == [1.5 * comm.size] * 3
                     and np.asarray(j).astype(np.float32).tolist() == [1.5 * comm.size] * 3)
    assert ml_dtypes.bfloat16  # the NumPy side of both is ml_dtypes.bfloat16
