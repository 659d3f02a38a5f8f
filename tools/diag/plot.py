"""``--plot``: busbw against size, to a PNG."""

from __future__ import annotations

from typing import Sequence

from commlib.tools.diag.table import Row
from commlib.tools.world import plural


def plot_busbw(rows: Sequence[Row], path: str, nranks: int) -> None:
    """busbw against size, log2 x axis, to a PNG (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4))
    axes.plot([row.size for row in rows], [row.busbw for row in rows], marker="o")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size per rank (B)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(f"commlib diag alltoall, {plural(nranks, 'rank')}")
    axes.grid(True, which="both", alpha=0.3)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot.close(figure)
