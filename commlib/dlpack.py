"""DLPack adapters: any framework's array in, the same framework's array out.

Collectives work on one array namespace, ``xp``: NumPy for host memory, CuPy
for CUDA memory. ``unwrap`` turns a NumPy, CuPy, PyTorch or JAX array into
that namespace without copying, and remembers how to turn a result back into
the caller's framework (``Native.wrap``), so torch in gives torch out.

Types that DLPack cannot carry (bfloat16, float8) travel as a same-sized
integer view and are viewed back on arrival: on the host as ``ml_dtypes``
types, which NumPy understands; on the GPU as raw integer storage, since CuPy
has no bfloat16 (transfers move bytes; reductions read ``Native.dtype``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

# DLPack device types (dlpack.h, DLDeviceType)
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


@runtime_checkable
class SupportsDLPack(Protocol):
    """Anything that exports DLPack: NumPy, CuPy, PyTorch, JAX arrays."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


@dataclass
class Native:
    """A caller's array seen as a NumPy or CuPy array.

    ``data`` shares memory with the caller's array (it may be read-only; it is
    never written). ``dtype`` is the logical element type, which differs from
    ``data.dtype`` only for bfloat16/float8 on the GPU. ``wrap(y)`` turns a
    result in ``xp`` with storage dtype ``data.dtype`` into the caller's
    framework, on the caller's device.
    """

    data: Any
    dtype: np.dtype
    on_device: bool
    framework: str
    wrap: Callable[[Any], Any]
    allocate: Optional[Callable[[Tuple[int, ...], np.dtype], Any]] = None

    @property
    def xp(self):
        if self.on_device:
            import cupy
            return cupy
        return np

    def empty(self, shape: Tuple[int, ...], dtype: Any = None):
        """An uninitialised result of ``shape`` and storage ``dtype`` (default:
        ``data``'s), seen in ``xp`` and allocated by the caller's framework:
        a torch CUDA result comes from torch's caching allocator, not from a
        second pool competing with it for the GPU."""
        dtype = self.data.dtype if dtype is None else np.dtype(dtype)
        if self.allocate is None:
            return self.xp.empty(shape, dtype=dtype)
        return self.allocate(tuple(shape), dtype)


@functools.lru_cache(maxsize=None)
def _ml_dtypes_twins() -> Dict[str, Tuple[np.dtype, np.dtype]]:
    """name -> (logical ml_dtypes dtype, same-sized integer storage dtype);
    made once (6 us: every torch tensor handed to a collective asks)."""
    import ml_dtypes
    names = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    twins = {}
    for name in names:
        if hasattr(ml_dtypes, name):
            logical = np.dtype(getattr(ml_dtypes, name))
            twins[name] = (logical, np.dtype(f"uint{8 * logical.itemsize}"))
    return twins


def _identity(y):
    return y


def _from_numpy(x) -> Native:
    return Native(x, x.dtype, False, "numpy", _identity)


def _from_cupy(x) -> Native:
    return Native(x, x.dtype, True, "cupy", _identity)


def _from_torch(x) -> Native:
    import torch

    # a non-contiguous tensor is copied by torch, on its own device and stream; each
    # step only where it changes something (each is an operation: issue 46 counts them)
    t = x.detach() if x.requires_grad else x
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    twins = _ml_dtypes_twins()
    on_device = t.device.type == "cuda"
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"torch tensors on {t.device.type!r} are not supported; "
                        f"move the tensor to 'cpu' or 'cuda' first")
    torch_dtype = t.dtype
    if name in twins:
        logical, storage = twins[name]
        t = t.view(getattr(torch, str(storage)))
    else:
        logical = storage = None
    allocate = None
    if on_device:
        import cupy
        data = cupy.from_dlpack(t)
        dtype = logical if logical is not None else data.dtype

        def allocate(shape, storage_dtype):
            raw = torch.empty(math.prod(shape) * storage_dtype.itemsize, dtype=torch.uint8,
                              device=t.device)
            return cupy.from_dlpack(raw).view(storage_dtype).reshape(shape)
    else:
        data = t.numpy()
        if logical is not None:
            data = data.view(logical)
        dtype = data.dtype

    def wrap(y):
        # results of the input's own type come back as it; others (float32
        # statistics of a bfloat16 input, say) as what they are
        same_type = logical is not None and y.dtype in (logical, storage)
        if on_device:
            out = torch.from_dlpack(y)
        else:
            out = torch.from_numpy(y.view(storage) if same_type else y)
        return out.view(torch_dtype) if same_type else out

    return Native(data, np.dtype(dtype), on_device, "torch", wrap, allocate)


def _from_jax(x) -> Native:
    import jax
    import jax.numpy as jnp

    on_device = x.__dlpack_device__()[0] in (_DL_CUDA, _DL_CUDA_MANAGED)
    twins = _ml_dtypes_twins()
    logical = np.dtype(x.dtype)
    bitcast = logical.name in twins
    if on_device:
        import cupy
        storage = twins[logical.name][1] if bitcast else logical
        src = jax.lax.bitcast_convert_type(x, storage) if bitcast else x
        data = cupy.from_dlpack(src)
    else:
        data = np.asarray(x)  # a read-only view of the host buffer; ml_dtypes for bfloat16

    def wrap(y):
        if on_device:
            out = jnp.from_dlpack(y)
            same_type = bitcast and y.dtype == twins[logical.name][1]
            return jax.lax.bitcast_convert_type(out, logical) if same_type else out
        return jax.device_put(y, home)  # the input's CPU device, not JAX's default (a GPU)

    home = None if on_device else next(iter(x.devices()))
    return Native(data, logical, on_device, "jax", wrap)


def _from_dlpack(x) -> Native:
    """Any other DLPack exporter: host memory as NumPy, device memory as CuPy."""
    if x.__dlpack_device__()[0] in (_DL_CUDA, _DL_CUDA_MANAGED):
        import cupy
        data = cupy.from_dlpack(x)
        return Native(data, data.dtype, True, "cupy", _identity)
    data = np.from_dlpack(x)
    return Native(data, data.dtype, False, "numpy", _identity)


_ADAPTERS: Dict[str, Callable[[Any], Native]] = {
    "numpy": _from_numpy,
    "cupy": _from_cupy,
    "torch": _from_torch,
    "jax": _from_jax,
    "jaxlib": _from_jax,
}


def unwrap(x: Any) -> Native:
    """The caller's array as NumPy (host) or CuPy (CUDA), without copying."""
    if type(x) is np.ndarray:
        return _from_numpy(x)
    root = type(x).__module__.split(".")[0]
    adapter = _ADAPTERS.get(root)
    if adapter is not None and (root != "cupy" or "cupy" in sys.modules):
        return adapter(x)
    if isinstance(x, SupportsDLPack):
        return _from_dlpack(x)
    if isinstance(x, (list, tuple, int, float, bool, complex)):
        return _from_numpy(np.asarray(x))
    raise TypeError(f"expected an array (NumPy, CuPy, PyTorch, JAX or any DLPack "
                    f"exporter), got {type(x).__module__}.{type(x).__qualname__}")


_NO_STREAM = contextlib.nullcontext()  # reusable: entering it does nothing


def callers_stream(x: Any):
    """A context in which CuPy's current stream is torch's current stream,
    for a torch CUDA tensor ``x`` (or a sequence starting with one, or its
    ``Native``) on CuPy's current device; a no-op otherwise. Every step of a
    collective then runs on the caller's stream: DLPack's stream handshake
    has nothing to order (CuPy's default would make torch record an event
    and the legacy stream wait on it, which a CUDA graph capture cannot
    contain), and NCCL joins a capture of that stream. JAX's binding sets
    XLA's stream itself."""
    if type(x) is np.ndarray:  # the common case, first: small calls feel every microsecond
        return _NO_STREAM
    if isinstance(x, (list, tuple)) and x:
        x = x[0]
    if isinstance(x, Native):
        if x.framework != "torch" or not x.on_device:
            return _NO_STREAM
        device = x.data.device.id
    elif type(x).__module__.split(".")[0] == "torch" and getattr(x, "is_cuda", False):
        device = x.device.index
    else:
        return _NO_STREAM
    import cupy
    if device != cupy.cuda.runtime.getDevice():  # refused later, naming both devices
        return _NO_STREAM
    torch = sys.modules["torch"]
    return cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream, device)


def contiguous(native: Native):
    """``native.data`` as a C-contiguous array: itself when it already is,
    else one copy (the only copy commlib makes of an input), in memory from
    the owner's allocator (torch's for torch: a CUDA graph capture may not
    allocate from CuPy's pool)."""
    data = native.data
    if data.flags.c_contiguous:
        return data
    copy = native.empty(data.shape, data.dtype)
    copy[...] = data
    return copy


def writable(data) -> bool:
    """Whether MPI or NCCL may receive into ``data``: NumPy says so in its
    flags; CuPy's flags have no ``writeable`` (device memory is always
    writable)."""
    return getattr(data.flags, "writeable", True)


def byte_view(data):
    """The bytes of a C-contiguous array as a 1-D uint8 array (no copy)."""
    return data.reshape(-1).view(np.uint8)
