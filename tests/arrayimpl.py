"""Array backends for tests: one test body, every framework (mpi4py's
``test/arrayimpl.py`` idea).

    @pytest.mark.parametrize("impl", arrayimpl.params())
    def test_something(impl):
        x = impl.asarray(np.ones((2, 3)), "bfloat16")  # a torch/JAX/... array
        ...
        assert impl.is_native(y) and np.allclose(impl.to_numpy(y), expected)

NumPy, torch (CPU), JAX (CPU) run everywhere; CuPy, torch CUDA and JAX on
the GPU ("jax-cuda") carry the ``gpu`` mark and skip, with the reason, where
there is no CUDA device (tests/cuda_probe.py: where there is one, a
framework that cannot use it is an error). "jax" means host arrays even
where JAX's default device is a GPU: they are placed on its CPU device
explicitly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import ml_dtypes
import numpy as np
import pytest

from cuda_probe import cuda_skip_reason

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
          "bfloat16": ml_dtypes.bfloat16, "int64": np.int64, "int32": np.int32,
          "bool": np.bool_}

# JAX would take 75% of the GPU when its GPU backend starts: the multi-rank
# tests put 2-4 ranks (and torch and CuPy beside JAX) on one GPU
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@dataclass(frozen=True)
class ArrayImpl:
    """How one framework makes, recognises and reads back arrays."""

    name: str
    framework: str
    make: Callable[[np.ndarray, str], Any]
    read: Callable[[Any], np.ndarray]
    gpu: bool = False

    def asarray(self, a: Any, dtype: Optional[str] = None) -> Any:
        """``a`` (NumPy or nested lists) in this framework, as ``dtype`` (a
        name: "float32", "bfloat16", ...; default: a's own)."""
        a = np.asarray(a)
        name = dtype or a.dtype.name
        return self.make(a.astype(DTYPES[name]) if name in DTYPES else a, name)

    def to_numpy(self, x: Any) -> np.ndarray:
        """A NumPy copy of ``x``; bfloat16 comes back as float32."""
        return self.read(x)

    def is_native(self, x: Any) -> bool:
        """Whether ``x`` belongs to this framework (and device)."""
        from commlib.namespace import framework, on_cuda
        try:
            return framework(x) == self.framework and on_cuda(x) == self.gpu
        except TypeError:
            return False

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def __repr__(self) -> str:
        return self.name


def _torch(device: str) -> ArrayImpl:
    def make(a, name):
        import torch
        if name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(device, torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def read(x):
        import torch
        x = x.detach()
        if x.dtype == torch.bfloat16:
            x = x.float()
        return x.cpu().numpy()
    return ArrayImpl("torch-cuda" if device == "cuda" else "torch", "torch", make, read,
                     gpu=device == "cuda")


def _jax(platform: str) -> ArrayImpl:
    """JAX arrays placed on the first ``platform`` ("cpu" or "gpu") device
    explicitly, not on JAX's default device (the GPU, where there is one)."""
    def make(a, name):
        import jax
        return jax.device_put(a, jax.devices(platform)[0])

    def read(x):
        a = np.asarray(x)
        return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a
    gpu = platform == "gpu"
    return ArrayImpl("jax-cuda" if gpu else "jax", "jax", make, read, gpu=gpu)


def _numpy() -> ArrayImpl:
    def read(x):
        a = np.asarray(x)
        return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a
    return ArrayImpl("numpy", "numpy", lambda a, name: a, read)


def _cupy() -> ArrayImpl:
    def make(a, name):
        import cupy
        return cupy.asarray(a)
    return ArrayImpl("cupy", "cupy", make, lambda x: x.get(), gpu=True)


IMPLS = {impl.name: impl for impl in (_numpy(), _torch("cpu"), _jax("cpu"), _cupy(),
                                      _torch("cuda"), _jax("gpu"))}
HOST = ("numpy", "torch", "jax")
GPU = ("cupy", "torch-cuda", "jax-cuda")


def params(names=tuple(IMPLS), exclude=()) -> List[Any]:
    """``pytest.param`` per backend, GPU ones marked ``gpu`` and skipped
    (with the reason) where no CUDA device is visible."""
    out = []
    for name in names:
        if name in exclude:
            continue
        impl = IMPLS[name]
        marks = []
        if impl.gpu:
            reason = cuda_skip_reason(impl.framework)
            marks = [pytest.mark.gpu] + ([pytest.mark.skip(reason=reason)] if reason else [])
        out.append(pytest.param(impl, id=name, marks=marks))
    return out
