"""How much memory a rank can still allocate, so that a collective refuses
a receive that cannot fit before allocating it, with the numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

# below this a receive is not worth a look at the system's counters
CHECK_FROM_BYTES = 64 * 2**20


def _meminfo_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> Optional[int]:
    """Limit minus usage of this process's cgroup (v2), if it has a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _device_free() -> int:
    """Free memory of the current GPU, by the driver."""
    import cupy
    return cupy.cuda.runtime.memGetInfo()[0]


def _cache_free(framework: str) -> int:
    """What the allocator that allocates ``framework``'s results on the GPU
    holds free in its cache: torch's caching allocator for torch, CuPy's
    pool for the rest (JAX outside jit included)."""
    if framework == "torch":
        import torch
        return torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    import cupy
    return cupy.get_default_memory_pool().free_bytes()


def available_bytes(on_device: bool, framework: str = "numpy") -> Optional[int]:
    """Bytes this rank can allocate now for a result owned by ``framework``
    (host memory, or the current GPU's free memory plus the owner's
    allocator cache), or None when the system does not say."""
    if on_device:
        return _device_free() + _cache_free(framework)
    known = [n for n in (_meminfo_available(), _cgroup_headroom()) if n is not None]
    return min(known) if known else None


def shortfall(nbytes: int, on_device: bool, framework: str = "numpy") -> Optional[str]:
    """None if ``nbytes`` fits, else why not, in words."""
    if nbytes < CHECK_FROM_BYTES:
        return None
    available = available_bytes(on_device, framework)
    if available is None or nbytes <= available:
        return None
    where = "GPU" if on_device else "host"
    hint = ""
    if on_device and framework == "jax":
        hint = (" (JAX preallocates most of the GPU: XLA_PYTHON_CLIENT_PREALLOCATE=false or a "
                "smaller XLA_PYTHON_CLIENT_MEM_FRACTION leaves room for commlib's buffers)")
    return (f"receiving would allocate {nbytes:,} bytes but only {available:,} bytes of "
            f"{where} memory are available on this rank{hint}")
