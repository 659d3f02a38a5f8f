"""A sequence of any length cut into equal, padded shards, and put back.

Rank ``r`` holds ``counts[r]`` real tokens (``np.array_split``'s counts: the
first ``length % size`` ranks one more), then zeros up to ``padded`` =
ceil(length / size), so that every rank's shard has the same length, as
commlib's attention needs. The attention keeps the padding invisible
(``_visibility.py``) and the gather cuts it.

Gradients: each rank's gradient of a tensor is its share, and the ranks'
shares sum to the gradient of the unsharded model. A shard's gradient is
placed in its rows of the whole (the split); a gathered whole's shares are
summed over the ranks and each rank takes its rows (the gather); the
model's output, from which every rank computes the same loss, counts a
1/P share on each rank (``as_shares``). So whatever a model computes on
every rank alike between a gather and the next split (Helios: norms,
residuals, its output projection), its weights get shares too, and summing
every weight's gradient over the ranks gives the unsharded model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

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
    """Every rank's shard along ``dim``, padding cut; backward: the shares
    of the whole's gradient summed, this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, split: Split, comm) -> torch.Tensor:
        ctx.dim, ctx.split, ctx.comm = dim, split, comm
        whole = comm.allgather(x.contiguous(), axis=dim)
        return whole.index_select(dim, split.kept(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        summed = ctx.comm.allreduce(grad.contiguous())
        return ctx.split.shard(summed, ctx.dim, ctx.comm.rank), None, None, None


def gather(x: torch.Tensor, dim: int, split: Split, comm) -> torch.Tensor:
    """The whole sequence from every rank's padded shard of it (differentiable)."""
    return _Gather.apply(x, dim, split, comm)


class _Share(torch.autograd.Function):
    """The identity; backward: a 1/``size`` share of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad / ctx.size, None


def as_shares(output: Any, size: int) -> Any:
    """The model's output (a tensor, a tuple, diffusers' output dataclass),
    its tensors that need a gradient counting a 1/``size`` share of it."""
    if isinstance(output, torch.Tensor):
        return _Share.apply(output, size) if output.requires_grad else output
    if type(output) is tuple:
        return tuple(as_shares(x, size) for x in output)
    if isinstance(output, dict):  # diffusers' BaseOutput is an OrderedDict
        for key in list(output):
            output[key] = as_shares(output[key], size)
    return output
