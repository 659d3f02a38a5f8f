"""The caller's array namespace: algorithms compute where the data lives.

Ring, Ulysses and MoE are written once against ``xp = namespace(x)``:
array-api-compat's namespace for NumPy, CuPy and PyTorch, ``jax.numpy`` for
JAX. So a torch CUDA bfloat16 tensor is computed on by torch, on its device,
in bfloat16; a NumPy array by NumPy. This module adds the few operations the
array API standard lacks and every algorithm needs: a scatter-add that
accumulates repeated indices, a C-contiguous copy, small metadata copied to
the host (counts the transport must know), counts and compaction that stay
on the device (so the host need not wait for it), rows as raw bytes (to pack
rows of different dtypes into one message), and the framework's name (to
pick its best kernel).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Tuple

import array_api_compat as compat
import array_api_extra as xpx
import numpy as np

FRAMEWORKS = ("numpy", "cupy", "torch", "jax")


def namespace(*arrays: Any) -> Any:
    """The array-API namespace of ``arrays`` (one framework for all): it
    depends on their types alone, so it is looked up once per combination
    (array-api-compat's answer costs microseconds, and a call asks often)."""
    types = tuple(map(type, arrays))
    found = _NAMESPACES.get(types)
    if found is None:
        found = _NAMESPACES[types] = compat.array_namespace(*arrays)
    return found


_NAMESPACES: dict = {}


def framework(x: Any) -> str:
    """"numpy", "cupy", "torch" or "jax": by type, remembered per type (the
    array-api-compat checks cost microseconds; issue 37)."""
    kind = type(x)
    if kind is np.ndarray and x.dtype.kind == "V":  # JAX's float0 zero gradients: by dtype
        return _framework(x)
    found = _FRAMEWORK_OF_TYPE.get(kind)
    if found is None:
        found = _FRAMEWORK_OF_TYPE[kind] = _framework(x)
    return found


_FRAMEWORK_OF_TYPE: dict = {}


def _framework(x: Any) -> str:
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
        import jax
        if isinstance(x, jax.core.Tracer):  # inside jit: where the program runs
            return jax.default_backend() == "gpu"
        return any(d.platform == "gpu" for d in x.devices())
    return False


def float32(x: Any) -> Any:
    """``x`` as float32 (itself when it already is): MoE's routing weights
    and sums are float32 whatever the rows' dtype."""
    xp = namespace(x)
    if x.dtype == xp.float32:  # itself, without an operation (torch records even a no-op cast)
        return x
    if framework(x) == "numpy" and x.dtype.name == "bfloat16":
        # ml_dtypes converts 2.4x slower than placing the 16 bits high in a float32
        return (x.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return xp.astype(x, xp.float32, copy=False)


def accumulator_dtype(*arrays: Any) -> Any:
    """The dtype attention's statistics (lse), accumulators and gradient
    partials take for these inputs: float64 where one of them is float64
    (float32 would cost it 1e-7 against 1e-16), else float32 (16-bit inputs
    need the range and precision; float32 its own)."""
    xp = namespace(*arrays)
    return xp.float64 if any(x.dtype == xp.float64 for x in arrays) else xp.float32


def accumulated(x: Any, like: Any = None) -> Any:
    """``x`` in the accumulator dtype of ``like`` (default ``x``): itself
    when it already is."""
    xp = namespace(x)
    return xp.astype(x, accumulator_dtype(x if like is None else like), copy=False)


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


def from_host_ints(values: Any, like: Any) -> Any:
    """A few host integers as a 1-D array beside ``like`` (its framework,
    device and index dtype), made by one fill each, not copied from host
    memory (NumPy excepted): on a GPU such a copy can make the host wait
    for the device's queued work, and a CUDA graph cannot capture it."""
    xp, where, kind = namespace(like), device(like), index_dtype(like)
    values = [int(v) for v in values]
    if framework(like) == "numpy":
        return np.asarray(values, dtype=kind)
    if not values:
        return xp.zeros(0, dtype=kind, device=where)
    return xp.concat([xp.full((1,), v, dtype=kind, device=where) for v in values])


def host_int(x: Any) -> int:
    """A 0-d integer array of any framework as a Python int: the scalar
    sibling of ``to_host`` (one device value, one wait), read without a
    detour through NumPy."""
    return int(x)


def is_traced(x: Any) -> bool:
    """Whether ``x`` is a value JAX is tracing (inside ``jit``, ``grad``,
    ``vmap``): it has no value yet, so nothing can be read from it."""
    if not compat.is_jax_array(x):
        return False
    import jax
    return isinstance(x, jax.core.Tracer)


def check_int(x: Any, check: Callable[[int], None]) -> None:
    """``check(value)`` of the 0-d integer array ``x``, where ``check``
    raises for a bad value: now, on the host (``host_int``: one wait), or,
    for a value JAX is tracing, inside the compiled program when it runs
    (an ``io_callback``, as the JAX MoE Dispatcher checks its expert ids),
    so tracing reads nothing and the jitted program still refuses bad
    data (JAX raises the error wrapped in its runtime error)."""
    if not is_traced(x):
        check(host_int(x))
        return
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    def run(value):
        check(int(value))
        return np.zeros((), np.uint8)
    io_callback(run, jax.ShapeDtypeStruct((), jnp.uint8), x)


def sum_rows(values: Any, index: Any, count: int, *, scale: Any = None, rows: Any = None,
             dtype: Any = None) -> Any:
    """Rows of ``values`` summed by ``index`` into ``count`` new rows:
    ``out[j] = sum over i with index[i] == j of scale[i] * values[rows[i]]``
    (``scale``: one factor per term, default 1; ``rows``: the row of
    ``values`` term i takes, default the i-th: one gather, not two), in
    ``dtype`` (default values'; bfloat16 rows into a float32 sum, say), in
    values' framework, on its device. Each sum adds its terms in index
    order."""
    xp = namespace(values)
    dtype = values.dtype if dtype is None else dtype
    out = xp.zeros((count,) + tuple(values.shape[1:]), dtype=dtype, device=device(values))
    kind = framework(values)
    if kind == "numpy":
        _sum_rows_in_rounds(out, index, values, scale, rows)
        return out
    if kind == "torch" and values.device.type == "cpu":
        _sum_rows_in_slices(out, index, values, scale, rows)
        return out
    if rows is not None:
        values = take_rows(values, rows)
    values = xp.astype(values, dtype, copy=False)
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


def _sum_rows_in_slices(out: Any, index: Any, values: Any, scale: Any, rows: Any) -> None:
    """torch on the CPU: ``index_add_`` of the terms a slice of
    ``_SLICE_BYTES`` at a time, where a term must be made first (gathered,
    converted or scaled). A temporary of every term at once is a fresh
    allocation the size of ``values`` whose page faults cost more than the
    sum (8192 rows x 4 KiB: 21 ms against 8); a slice's is reused, warm in
    cache. The CPU kernel adds in index order, slice after slice, so the
    sums are one call's, bit for bit."""
    terms = index.shape[0]
    if rows is None and scale is None and values.dtype == out.dtype:
        out.index_add_(0, index, values)  # no term to make
        return
    step = max(1, _SLICE_BYTES // max(1, out.itemsize * math.prod(out.shape[1:])))
    for low in range(0, terms, step):
        high = min(low + step, terms)
        part = values[low:high] if rows is None else values.index_select(0, rows[low:high])
        part = part.to(out.dtype)
        if scale is not None:
            part = part * _per_row(scale[low:high], part.ndim)
        out.index_add_(0, index[low:high], part)


# bytes of terms sum_rows makes at a time in torch on the CPU
_SLICE_BYTES = 2 << 20


def _sum_rows_in_rounds(out: np.ndarray, index: np.ndarray, values: np.ndarray,
                        scale: Any, rows: Any) -> None:
    """NumPy's scatter-add into zeros, in rounds: round d adds every row's
    d-th term, and within a round no row repeats, so plain fancy-index
    assignment (round 0, onto zeros) and += are correct. With a handful of
    terms per row that is 10x faster than np.add.at (each round's terms are
    scaled where they were gathered). Terms beyond the first ``_ROUNDS`` of
    a row (a fixed capacity's padding all lands on one spare row) are
    summed with one ``np.add.reduceat`` instead of a round each."""
    if index.size == 0:
        return
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    depth = np.arange(index.size) - np.repeat(starts, np.diff(np.r_[starts, index.size]))

    def scaled(pick):
        part = values[pick if rows is None else rows[pick]].astype(out.dtype, copy=False)
        if scale is not None:  # part is a fresh copy: scaled in place
            part *= _per_row(scale[pick], values.ndim)
        return part
    for round_ in range(min(int(depth.max()) + 1, _ROUNDS)):
        pick = order[depth == round_]
        if round_:
            out[index[pick]] += scaled(pick)
        else:
            out[index[pick]] = scaled(pick)
    deep = depth >= _ROUNDS  # in index order: each deep row's group is contiguous
    if deep.any():
        rest = order[deep]
        firsts = np.flatnonzero(np.r_[True, ordered[deep][1:] != ordered[deep][:-1]])
        out[index[rest[firsts]]] += np.add.reduceat(scaled(rest), firsts, axis=0)


# rounds of sum_rows before the rest of a row's terms are summed at once
_ROUNDS = 16


def bincount(x: Any, n: int) -> Any:
    """How often each of 0..n-1 occurs in the integer array ``x`` (values
    outside are ignored), as an [n] array of x's index dtype in x's own
    framework, on its device: a scatter-add of ones, which never reads data
    on the host. (``torch.bincount`` and ``cupy.bincount`` on a GPU read the
    largest value back to size their result; NumPy's bincount runs on the
    host anyway.)"""
    xp = namespace(x)
    flat = xp.reshape(x, (-1,))
    inside = (flat >= 0) & (flat < n)
    if framework(x) == "numpy":
        return np.bincount(np.where(inside, flat, n), minlength=n + 1)[:n].astype(
            index_dtype(x), copy=False)
    kind = index_dtype(x)
    tally = sum_rows(xp.ones(flat.shape, dtype=kind, device=device(x)),  # slot n: the outside
                     xp.astype(xp.where(inside, flat, n), kind, copy=False), n + 1)
    return tally[:n]


def sort_permutation(x: Any, bound: int) -> Tuple[Any, Any]:
    """(the stable permutation that sorts the 1-D integers ``x``, its
    inverse), where only the values in [-1, ``bound``) need their own place
    (those below sort first, those above last). Two stable argsorts (torch:
    two ops), but in JAX one sort of a packed int32 key (value * n +
    position) where it fits, and a scatter for the inverse: XLA sorts one
    operand 7x faster than a key with a payload (3.3 against 21.6 ms for
    32768 ids on the CPU) and scatters a permutation 60x faster than it
    sorts one. Fixed sizes: it traces under ``jax.jit``."""
    if framework(x) != "jax":
        xp = namespace(x)
        order = xp.argsort(x, stable=True)
        return order, xp.argsort(order)
    import jax
    import jax.numpy as jnp
    n = x.shape[0]
    iota = jnp.arange(n, dtype=jnp.int32)
    if (bound + 2) * max(n, 1) < 2 ** 31:
        key = (jnp.clip(x, -1, bound).astype(jnp.int32) + 1) * n + iota
        order = jnp.sort(key) % max(n, 1)
    else:
        order = jax.lax.sort((x, iota), num_keys=1, is_stable=True)[1]
    return order, jnp.zeros(n, jnp.int32).at[order].set(iota, unique_indices=True)


def compact(values: Any, keep: Any, n: int) -> Any:
    """``values[keep]`` for 1-D ``values`` and a boolean ``keep`` with ``n``
    true entries, ``n`` already known on the host: a cumulative sum and a
    scatter of fixed size, so the device is never asked how many entries
    survive (boolean indexing is; NumPy, on the host, keeps its mask)."""
    xp = namespace(values)
    if framework(values) == "numpy":
        return values[keep]
    kind = index_dtype(values)
    slot = xp.cumulative_sum(xp.astype(keep, kind)) - 1
    out = xp.zeros(n + 1, dtype=values.dtype, device=device(values))  # slot n: the rest
    return xpx.at(out)[xp.where(keep, slot, n)].set(values)[:n]


def take_rows(x: Any, index: Any, out: Any = None) -> Any:
    """``x``'s rows at ``index`` (1-D integers, none negative), in x's
    framework; into ``out`` (of the result's shape and dtype, not JAX) when
    given. NumPy indexes rather than ``take``s: np.take first copies a
    strided ``x`` whole (4x slower on the rows ``from_bytes`` views out of a
    message), and with ``out`` it takes in "clip" mode (its default mode
    first writes to a scratch copy); torch's ``index_select`` is called
    directly (the array API's ``take`` first wraps negative indices: three
    more ops per call)."""
    kind = framework(x)
    if kind == "numpy":
        return x[index] if out is None else np.take(x, index, axis=0, out=out, mode="clip")
    if kind == "torch":
        if out is None:
            return x.index_select(0, index)
        import torch
        return torch.index_select(x, 0, index, out=out)
    if out is not None:  # CuPy
        return x.take(index, axis=0, out=out)
    return namespace(x).take(x, index, axis=0)


def zeroed_rows(x: Any, keep: Any) -> Any:
    """``x`` [rows, ...] with the rows where the boolean ``keep`` is False
    set to +0, whatever they held: their bits are multiplied by 0 or 1, in
    place. A NaN row times a zero weight stays NaN, and ``where`` with a
    broadcast mask costs torch on the CPU about 7x the multiply (issue 37).
    ``x`` must be a fresh array the caller owns; JAX's are immutable, and
    take ``where``."""
    xp = namespace(x)
    shape = (-1,) + (1,) * (x.ndim - 1)
    kind = framework(x)
    if kind == "jax":
        return xp.where(xp.reshape(keep, shape), x, xp.zeros((), dtype=x.dtype))
    itemsize = x.element_size() if kind == "torch" else x.dtype.itemsize
    if kind == "torch":
        import torch
        bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    else:
        bits = np.dtype(f"i{itemsize}")
    raw = x.view(bits)
    raw *= xp.reshape(xp.astype(keep, raw.dtype), shape)
    return x


def as_bytes(x: Any) -> Any:
    """The rows of ``x`` [rows, ...] as raw bytes, uint8 [rows, row bytes],
    in x's framework: a view of a C-contiguous array (JAX: a bitcast). What
    lets rows of different dtypes share one message."""
    kind = framework(x)
    rows = x.shape[0]
    nbytes = x.itemsize * math.prod(x.shape[1:])
    if kind == "torch":
        import torch
        if x.numel() == 0:  # an empty tensor's strides may refuse the view
            return torch.empty((rows, nbytes), dtype=torch.uint8, device=x.device)
        return x.contiguous().view(torch.uint8).reshape(rows, nbytes)
    if kind == "jax":
        import jax
        return jax.lax.bitcast_convert_type(x, np.uint8).reshape(rows, nbytes)
    return contiguous(x).view(np.uint8).reshape(rows, nbytes)


def from_bytes(raw: Any, dtype: Any, row_shape: Tuple[int, ...]) -> Any:
    """``as_bytes`` undone: uint8 [rows, n] (a column slice of a wider byte
    array is fine) as ``dtype`` [rows, *row_shape], in raw's framework; a
    view where the framework can make one, else one copy."""
    kind = framework(raw)
    rows = raw.shape[0]
    if kind == "jax":
        import jax
        size = np.dtype(dtype).itemsize
        shaped = raw.reshape((rows, raw.shape[1] // size, size) if size > 1 else raw.shape)
        return jax.lax.bitcast_convert_type(shaped, dtype).reshape((rows,) + tuple(row_shape))
    if kind == "torch" and raw.numel() == 0:  # an empty tensor's strides may refuse the view
        import torch
        return torch.empty((rows,) + tuple(row_shape), dtype=dtype, device=raw.device)
    try:
        viewed = raw.view(dtype)
    except (RuntimeError, ValueError):  # strides or an offset the view cannot express:
        # one fresh copy, flattened (torch counts one row of any stride or storage offset
        # as contiguous, and would keep both)
        if kind == "torch":
            import torch
            viewed = raw.clone(memory_format=torch.contiguous_format).reshape(-1).view(dtype)
        else:
            viewed = contiguous(raw).reshape(-1).view(dtype)
    return viewed.reshape((rows,) + tuple(row_shape))


def index_dtype(x: Any) -> Any:
    """The integer dtype x's framework indexes with: int64, except JAX
    without x64, where asking for int64 truncates to int32 with a warning.
    NumPy's and a plain torch tensor's answered directly (asked a thousand
    times a decode-sized MoE pair; issue 37); JAX's depends on x64, asked."""
    kind = type(x)
    if kind is np.ndarray:
        return _NUMPY_INT64
    if kind.__module__ == "torch" and kind.__name__ == "Tensor":
        import torch
        return torch.int64
    return namespace(x).__array_namespace_info__().default_dtypes()["indexing"]


_NUMPY_INT64 = np.dtype(np.int64)


def device(x: Any) -> Any:
    """The device ``x`` lives on, to allocate beside it. A NumPy array's and a
    plain torch tensor's are read directly (array-api-compat's answer costs
    microseconds, and a decode-sized MoE pair asks 24 times; issue 37)."""
    kind = type(x)
    if kind is np.ndarray:
        return "cpu"
    if kind.__module__ == "torch" and kind.__name__ == "Tensor":
        return x.device
    return compat.device(x)


def dtype_name(x: Any) -> str:
    """The element type's name, the same in every framework: "bfloat16",
    "float32", ... (what ranks compare when they check their arguments)."""
    return str(x.dtype).removeprefix("torch.")


def detached(*arrays: Any) -> tuple:
    """The arrays without autograd history (torch tensors detached): the
    algorithms compute values; gradients are the bindings' business."""
    return tuple(x.detach() if compat.is_torch_array(x) and x.requires_grad else x
                 for x in arrays)
