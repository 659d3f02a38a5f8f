"""A sequence of any length cut into equal, padded shards, and put back.

Rank ``r`` holds ``counts[r]`` real tokens (``np.array_split``'s counts: the
first ``length % size`` ranks one more), then zeros up to ``padded`` =
ceil(length / size), so that every rank's shard has the same length, as
commlib's attention needs. The attention keeps the padding invisible
(``_visibility.py``) and the gather cuts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class Split:
    """``length`` tokens over ``size`` ranks."""

    length: int
    size: int

    @property
    def counts(self) -> List[int]:
        base, extra = divmod(self.length, self.size)
        return [base + (r < extra) for r in range(self.size)]

    @property
    def starts(self) -> List[int]:
        return [0] + np.cumsum(self.counts)[:-1].tolist()

    @property
    def padded(self) -> int:
        return -(-self.length // self.size)

    def real(self, rank: int) -> Tuple[int, int]:
        """Rank ``rank``'s real tokens in its shard: [0, count)."""
        return 0, self.counts[rank]

    def shard(self, x: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s tokens of ``x`` along ``dim``, zero-padded."""
        start, count = self.starts[rank], self.counts[rank]
        piece = x.narrow(dim, start, count)
        missing = self.padded - count
        if missing == 0:
            return piece
        shape = list(x.shape)
        shape[dim] = missing
        return torch.cat([piece, x.new_zeros(shape)], dim=dim)

    def kept(self, device: torch.device) -> torch.Tensor:
        """The indices of the real tokens in the gathered [shard 0 | shard 1 | ...]."""
        index = [r * self.padded + i for r, count in enumerate(self.counts) for i in range(count)]
        return torch.tensor(index, dtype=torch.long, device=device)


class _Gather(torch.autograd.Function):
    """Every rank's shard along ``dim``, padding cut; the gradient of a
    rank's shard is its rows of the gathered gradient (every rank holds the
    same gathered output and computes the same loss from it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, split: Split, comm) -> torch.Tensor:
        ctx.dim, ctx.split, ctx.rank = dim, split, comm.rank
        whole = comm.allgather(x.contiguous(), axis=dim)
        return whole.index_select(dim, split.kept(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        split, dim = ctx.split, ctx.dim
        mine = split.shard(grad, dim, ctx.rank)
        return mine, None, None, None


def gather(x: torch.Tensor, dim: int, split: Split, comm) -> torch.Tensor:
    """The whole sequence from every rank's padded shard of it (differentiable)."""
    return _Gather.apply(x, dim, split, comm)
