"""nccl-tests' sweep, as the diag commands take it: sizes in its notation
(``1K``, ``64M``), element types, and the options -b -e -f -n -w -c --dtype
handed to a command as one ``Sweep``."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, List

import click
import ml_dtypes
import numpy as np

_SIZE_SUFFIXES = {"": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}


# -- option types ------------------------------------------------------------
def parse_size(text: str) -> int:
    """Bytes from nccl-tests notation: a positive whole number with an
    optional K, M or G suffix (powers of 1024), e.g. ``64K``."""
    raw = text.strip()
    suffix = raw[-1:].upper() if raw[-1:].isalpha() else ""
    digits = raw[:len(raw) - len(suffix)]
    if suffix not in _SIZE_SUFFIXES or not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"{text!r} is not a size: use a positive whole number of bytes, "
                         f"optionally followed by K, M or G (powers of 1024), e.g. 64K")
    return int(digits) * _SIZE_SUFFIXES[suffix]


def parse_dtype(name: str) -> np.dtype:
    """A numeric element type by name: NumPy's (float32, int8, bool, ...)
    or ml_dtypes' (bfloat16, float8_e4m3fn, ...), which NumPy cannot name."""
    extension = getattr(ml_dtypes, name, None)
    try:
        dtype = np.dtype(extension if extension is not None else name)
    except TypeError:
        dtype = None
    numeric = dtype is not None and (dtype.kind in "biufc"
                                     or (extension is not None and dtype.kind == "V"))
    if not numeric:
        raise ValueError(f"{name!r} is not a numeric element type: use a NumPy name "
                         f"(float32, float16, int32, ...) or an ml_dtypes one (bfloat16, "
                         f"float8_e4m3fn, ...)")
    return dtype


class ByteSize(click.ParamType):
    """Click type for ``parse_size``: a bad size is a usage error (exit 2)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class ElementType(click.ParamType):
    """Click type for ``parse_dtype``: an unknown type is a usage error."""

    name = "dtype"

    def convert(self, value, param, ctx) -> np.dtype:
        if isinstance(value, np.dtype):
            return value
        try:
            return parse_dtype(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


# -- the sweep every diag command runs -----------------------------------------
@dataclass(frozen=True)
class Sweep:
    """nccl-tests' common settings: sizes from -b to -e bytes per rank,
    stepping by -f, -w untimed and -n timed iterations each, -c check."""

    minbytes: int
    maxbytes: int
    stepfactor: int
    iters: int
    warmup_iters: int
    check: int
    dtype: np.dtype

    def sizes(self) -> List[int]:
        """minbytes, times stepfactor, and so on up to maxbytes."""
        sizes = []
        size = self.minbytes
        while size <= self.maxbytes:
            sizes.append(size)
            size *= self.stepfactor
        return sizes

    def describe(self) -> str:
        """The settings, as nccl-tests' header line states them."""
        return (f"# minBytes {self.minbytes} maxBytes {self.maxbytes} step: "
                f"{self.stepfactor}(factor) warmup iters: {self.warmup_iters} iters: "
                f"{self.iters} validation: {self.check} dtype: {self.dtype.name}")


_SWEEP_OPTIONS = (
    click.option("-b", "--minbytes", type=ByteSize(), default="1K", show_default=True,
                 help="Smallest size: bytes each rank sends in total (K, M, G suffixes)."),
    click.option("-e", "--maxbytes", type=ByteSize(), default="1M", show_default=True,
                 help="Largest size, in the same notation."),
    click.option("-f", "--stepfactor", type=click.IntRange(min=2), default=2,
                 show_default=True, help="Multiply the size by this between rows."),
    click.option("-n", "--iters", type=click.IntRange(min=1), default=20, show_default=True,
                 help="Timed iterations per size."),
    click.option("-w", "--warmup_iters", type=click.IntRange(min=0), default=5,
                 show_default=True, help="Untimed iterations before timing."),
    click.option("-c", "--check", type=click.IntRange(0, 1), default=1, show_default=True,
                 help="1: check every received element; 0: skip (#wrong is N/A)."),
    click.option("--dtype", type=ElementType(), default="float32", show_default=True,
                 help="Element type: a NumPy name, or bfloat16 / float8_* (ml_dtypes)."),
)


def sweep_options(command: Callable) -> Callable:
    """Give a diag command nccl-tests' options, handed to it as one
    ``sweep: Sweep`` once -b is known not to exceed -e."""
    @functools.wraps(command)
    def with_sweep(*args, minbytes: int, maxbytes: int, stepfactor: int, iters: int,
                   warmup_iters: int, check: int, dtype: np.dtype, **kwargs):
        if minbytes > maxbytes:
            raise click.BadParameter(f"{minbytes} bytes is larger than --maxbytes "
                                     f"({maxbytes} bytes); the sweep runs from -b up to -e",
                                     param_hint="'-b' / '--minbytes'")
        sweep = Sweep(minbytes, maxbytes, stepfactor, iters, warmup_iters, check, dtype)
        return command(*args, sweep=sweep, **kwargs)

    for option in reversed(_SWEEP_OPTIONS):
        with_sweep = option(with_sweep)
    return with_sweep
