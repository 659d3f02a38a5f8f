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


def available_bytes(on_device: bool) -> Optional[int]:
    """Bytes this rank can allocate now (host, or the current GPU), or None
    when the system does not say."""
    if on_device:
        import cupy
        free, _total = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        return free + pool.free_bytes()
    known = [n for n in (_meminfo_available(), _cgroup_headroom()) if n is not None]
    return min(known) if known else None


def shortfall(nbytes: int, on_device: bool) -> Optional[str]:
    """None if ``nbytes`` fits, else why not, in words."""
    if nbytes < CHECK_FROM_BYTES:
        return None
    available = available_bytes(on_device)
    if available is None or nbytes <= available:
        return None
    where = "GPU" if on_device else "host"
    return (f"receiving would allocate {nbytes:,} bytes but only {available:,} bytes of "
            f"{where} memory are available on this rank")
