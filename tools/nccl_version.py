"""NCCL's version as CuPy reports it, for ``commlib info`` and the GPU check."""

from __future__ import annotations


def nccl_version() -> str:
    """NCCL's version as CuPy reports it (e.g. 22005 -> 2.20.5), or why not.
    Any failure (no CuPy, no NCCL, no driver) is a fact to print, not an error."""
    try:
        from cupy.cuda import nccl as cupy_nccl

        code = int(cupy_nccl.get_version())
    except Exception as error:  # noqa: BLE001 - every failure is reported
        return f"unknown ({type(error).__name__})"
    return nccl_version_text(code)


def nccl_version_text(code: int) -> str:
    """NCCL's version code as a version: 22005 -> 2.20.5 (2.9 and older: 2904)."""
    major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"
