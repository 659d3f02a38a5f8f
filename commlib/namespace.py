"""The caller's array namespace: algorithms compute where the data lives.

Ring, Ulysses and MoE are written once against ``xp = namespace(x)``:
array-api-compat's namespace for NumPy, CuPy and PyTorch, ``jax.numpy`` for
JAX. So a torch CUDA bfloat16 tensor is computed on by torch, on its device,
in bfloat16; a NumPy array by NumPy. This module adds the few operations the
array API standard lacks and every algorithm needs: a scatter-add that
accumulates repeated indices, a C-contiguous copy, small metadata copied to
the host (counts the transport must know), and the framework's name (to pick
its best kernel).
"""

from __future__ import annotations

from typing import Any

import array_api_compat as compat
import numpy as np

FRAMEWORKS = ("numpy", "cupy", "torch", "jax")


def namespace(*arrays: Any) -> Any:
    """The array-API namespace of ``arrays`` (one framework for all)."""
    return compat.array_namespace(*arrays)


def framework(x: Any) -> str:
    """"numpy", "cupy", "torch" or "jax"."""
    if compat.is_torch_array(x):
        return "torch"
    if compat.is_jax_array(x):
        return "jax"
    if compat.is_cupy_array(x):
        return "cupy"
    if compat.is_numpy_array(x):
        return "numpy"
    raise TypeError(f"expected a NumPy, CuPy, PyTorch or JAX array, got "
                    f"{type(x).__module__}.{type(x).__qualname__}")


def framework_of(name: str, x: Any) -> str:
    """``framework(x)`` for the argument called ``name``, or a ValueError
    (not a TypeError: a problem the algorithms report to every rank)."""
    try:
        return framework(x)
    except TypeError:
        raise ValueError(f"{name} must be a NumPy, CuPy, PyTorch or JAX array, got "
                         f"{type(x).__module__}.{type(x).__qualname__}") from None


def on_cuda(x: Any) -> bool:
    """Whether ``x`` lives in CUDA memory."""
    kind = framework(x)
    if kind == "torch":
        return x.device.type == "cuda"
    if kind == "cupy":
        return True
    if kind == "jax":
        return any(d.platform == "gpu" for d in x.devices())
    return False


def float32(x: Any) -> Any:
    """``x`` as float32 (itself when it already is): statistics and
    accumulators are float32 whatever the input dtype."""
    xp = namespace(x)
    return xp.astype(x, xp.float32, copy=False)


def contiguous(x: Any) -> Any:
    """``x`` in C order: itself when it already is, else one copy, made by
    its own framework (on its own stream, for CUDA arrays)."""
    kind = framework(x)
    if kind == "torch":
        return x.contiguous()
    if kind == "jax":
        return x  # JAX arrays are always dense, row-major
    return namespace(x).ascontiguousarray(x) if not x.flags.c_contiguous else x


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of small metadata (counts, indices the transport must
    know): the one place an algorithm waits for a device."""
    kind = framework(x)
    if kind == "torch":
        return x.detach().cpu().numpy()
    if kind == "cupy":
        return x.get()
    return np.asarray(x)


def scatter_add(out: Any, index: Any, values: Any, scale: Any = None) -> Any:
    """``out[index[i]] += scale[i] * values[i]`` along axis 0 (``scale``: one
    factor per row, default 1), with repeated indices accumulating (which
    ``x[index] += v`` does not), in out's dtype (bfloat16 values into a
    float32 sum, say). In place for NumPy, CuPy and PyTorch; JAX returns the
    new array. Always use the result."""
    kind = framework(out)
    if kind == "numpy":  # widens and scales each round's rows as it adds them
        _scatter_add_rounds(out, index, values, scale)
        return out
    values = namespace(values).astype(values, out.dtype, copy=False)
    if scale is not None:
        values = values * _per_row(scale, values.ndim)
    if kind == "torch":
        return out.index_add_(0, index, values)
    if kind == "jax":
        return out.at[index].add(values)
    import cupyx
    cupyx.scatter_add(out, index, values)
    return out


def _per_row(scale: Any, ndim: int) -> Any:
    """One factor per row [n], shaped to broadcast against [n, ...] rows."""
    return namespace(scale).reshape(scale, (-1,) + (1,) * (ndim - 1))


def _scatter_add_rounds(out: np.ndarray, index: np.ndarray, values: np.ndarray,
                        scale: Any) -> None:
    """NumPy's scatter-add in rounds: round d adds every row's d-th
    contribution, and within a round no row repeats, so plain fancy-index
    += is correct. With a handful of contributions per row that is 6x
    faster than np.add.at."""
    if index.size == 0:
        return
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    depth = np.arange(index.size) - np.repeat(starts, np.diff(np.r_[starts, index.size]))
    for round_ in range(int(depth.max()) + 1):
        pick = order[depth == round_]
        part = values[pick]
        if scale is not None:
            part = part * _per_row(scale[pick], values.ndim)
        out[index[pick]] += part


def counts(x: Any, n: int) -> np.ndarray:
    """How often each of 0..n-1 occurs in the integer array ``x`` (values
    outside are ignored), as host int64: a sort and a search in x's own
    framework, then n+1 numbers to the host (NumPy: a bincount, 15x faster
    than the sort)."""
    if framework(x) == "numpy":
        inside = x[(x >= 0) & (x < n)]
        return np.bincount(inside.reshape(-1), minlength=n).astype(np.int64, copy=False)
    xp = namespace(x)
    ordered = xp.sort(xp.reshape(x, (-1,)))
    bounds = xp.arange(n + 1, dtype=ordered.dtype, device=compat.device(x))
    edges = to_host(xp.searchsorted(ordered, bounds)).astype(np.int64)
    return np.diff(edges)


def index_dtype(x: Any) -> Any:
    """The integer dtype x's framework indexes with: int64, except JAX
    without x64, where asking for int64 truncates to int32 with a warning."""
    return namespace(x).__array_namespace_info__().default_dtypes()["indexing"]


def device(x: Any) -> Any:
    """The device ``x`` lives on, to allocate beside it."""
    return compat.device(x)


def dtype_name(x: Any) -> str:
    """The element type's name, the same in every framework: "bfloat16",
    "float32", ... (what ranks compare when they check their arguments)."""
    return str(x.dtype).removeprefix("torch.")


def detached(*arrays: Any) -> tuple:
    """The arrays without autograd history (torch tensors detached): the
    algorithms compute values; gradients are the bindings' business."""
    return tuple(x.detach() if compat.is_torch_array(x) else x for x in arrays)
