"""Whether a framework's GPU tests can run here, told apart from why not.

No CUDA device on this machine (no driver, or a driver that sees none) is a
clean skip, whose reason begins "no CUDA device here" (the multi-rank
suite's allowlist knows it). A device with a framework that has no CUDA
support installed (not installed, a CPU build, JAX without its CUDA plugin)
is a missing requirement: a skip, an error under ``COMMLIB_TEST_REQUIRE=all``
(tests/requires.py). A device with a framework that has CUDA support and
still cannot use it (a broken driver, CuPy built for another CUDA) is an
error always: skipping would hide every GPU case.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.metadata
import pkgutil
from typing import Callable, Dict, List, Optional

import requires

NO_DEVICE = "no CUDA device here"
# cuInit's answers that mean "no GPU on this machine", not "a GPU, broken"
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_STUB_LIBRARY = 34  # the toolkit's link stub, not a driver


class CudaBrokenError(RuntimeError):
    """CUDA is present here but a framework with CUDA support cannot use it."""


@functools.lru_cache(maxsize=None)
def cuda_skip_reason(framework: str) -> Optional[str]:
    """None when ``framework`` ("cupy", "torch" or "jax") can use a CUDA
    device here; else the reason to skip its GPU cases. Raises
    ``CudaBrokenError`` where CUDA is present but broken."""
    absent = _no_device_reason()
    return absent if absent is not None else _FRAMEWORKS[framework]()


@functools.lru_cache(maxsize=None)
def _no_device_reason() -> Optional[str]:
    """Why this machine has no CUDA device, or None where the driver sees one."""
    try:
        driver = _load_driver()
    except OSError:
        return f"{NO_DEVICE}: no CUDA driver (libcuda.so.1 not found)"
    status = driver.cuInit(0)
    if status in (CUDA_ERROR_NO_DEVICE, CUDA_ERROR_STUB_LIBRARY):
        return f"{NO_DEVICE}: the CUDA driver sees no device (cuInit: error {status})"
    count = ctypes.c_int(0)
    if status == 0:
        status = driver.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        raise CudaBrokenError(f"the CUDA driver is installed but fails (CUDA error {status}): "
                              "fix the driver, or hide the GPUs (CUDA_VISIBLE_DEVICES=) "
                              "to test without them")
    return None if count.value > 0 else f"{NO_DEVICE}: the CUDA driver sees no device"


def _load_driver():
    return ctypes.CDLL("libcuda.so.1")


def _broken(framework: str, error: object) -> CudaBrokenError:
    return CudaBrokenError(f"the CUDA driver sees a device but {framework}, built with CUDA "
                           f"support, cannot use it ({error}): fix the install, or hide the "
                           f"GPUs (CUDA_VISIBLE_DEVICES=) to test without them")


def _installed(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name and error.name.partition(".")[0] == name:
            return None
        raise _broken(name, error) from error
    except ImportError as error:
        raise _broken(name, error) from error


def _torch() -> Optional[str]:
    torch = _installed("torch")
    if torch is None:
        return requires.skip_reason("a CUDA device is here but torch is not installed")
    if torch.version.cuda is None:
        return requires.skip_reason(f"a CUDA device is here but torch {torch.__version__} "
                                    "is a build without CUDA")
    if not torch.cuda.is_available():
        try:
            torch.cuda.init()
        except Exception as error:
            raise _broken("torch", error) from error
        raise _broken("torch", "torch.cuda.is_available() is False")
    return None


def _jax() -> Optional[str]:
    jax = _installed("jax")
    if jax is None:
        return requires.skip_reason("a CUDA device is here but JAX is not installed")
    try:
        jax.devices("gpu")
        return None
    except RuntimeError as error:
        if not _jax_cuda_plugins():
            return requires.skip_reason("a CUDA device is here but JAX has no CUDA plugin "
                                        "(pip install 'jax[cuda12]')")
        raise _broken("jax", error) from error


def _jax_cuda_plugins() -> List[str]:
    """The CUDA PJRT plugins JAX would find (entry points, jax_plugins.*)."""
    names = {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
    try:
        import jax_plugins
        names |= {found.name for found in pkgutil.iter_modules(jax_plugins.__path__)}
    except ImportError:
        pass
    return sorted(name for name in names if "cuda" in name)


def _cupy() -> Optional[str]:
    cupy = _installed("cupy")
    if cupy is None:
        return requires.skip_reason("a CUDA device is here but CuPy is not installed")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: CuPy's CUDA and the driver's disagree
        raise _broken("cupy", error) from error
    if count == 0:
        raise _broken("cupy", "CuPy counts no device")
    return None


_FRAMEWORKS: Dict[str, Callable[[], Optional[str]]] = {"torch": _torch, "jax": _jax,
                                                       "cupy": _cupy}
