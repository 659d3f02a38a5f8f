"""Kept for programs that import ``commlib.ring.merge``: the online-softmax
merge is the block kernels' (``commlib.kernels.merge``), which Ring, Ulysses
and the hybrid all use."""

from ..kernels.merge import merge

__all__ = ["merge"]
