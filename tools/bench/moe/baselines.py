"""What a user writes by hand in mpi4py (and torch) for the exchanges the
MoE benchmarks time commlib against: the every-pair dispatcher
(``throughput``), the plain decode slots (``decode``, tests/mpi/test_decode_ops.py),
the count exchange + ``Alltoallv`` (``latency``) and the bare exchange of a
dispatch + combine's bytes (``frameworks``, ``decode``)."""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Callable, List, Optional

import numpy as np
from mpi4py import MPI


def megatron_style(world: MPI.Comm, num_experts: int) -> Callable:
    """Every (token, expert) pair is its own row on the wire: permute by
    destination, count exchange, Alltoallv there and back, weighted sum."""
    size = world.Get_size()
    per_rank = num_experts // size

    def run(x, experts, weights):
        tokens, k = experts.shape
        pair_token = np.repeat(np.arange(tokens), k)
        dest = experts.reshape(-1) // per_rank
        order = np.argsort(dest, kind="stable")
        send = x[pair_token[order]]
        counts = np.bincount(dest, minlength=size).astype(np.int64)
        recv_counts = np.empty_like(counts)
        world.Alltoall(counts, recv_counts)
        row = x.shape[1] * x.itemsize
        received = np.empty((int(recv_counts.sum()), x.shape[1]), x.dtype)
        world.Alltoallv([send, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE],
                        [received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE])
        back = np.empty_like(send)  # identity experts: the rows go straight back
        world.Alltoallv([received, (recv_counts * row, (np.cumsum(recv_counts) - recv_counts)
                                    * row), MPI.BYTE],
                        [back, (counts * row, (np.cumsum(counts) - counts) * row), MPI.BYTE])
        per_pair = np.empty_like(back)
        per_pair[order] = back
        weighted = per_pair.reshape(tokens, k, -1) * weights[..., None]
        return weighted.sum(axis=1), int(send.nbytes)
    return run


class PlainSlots:
    """The decode pair a user writes by hand in torch + mpi4py (issue 46's
    baseline, DeepEP's low-latency layout): every expert has ``capacity``
    slots per source rank, a token's slot is its row, so placing the rows
    is one ``index_copy_``; one ``Alltoall`` each way over buffers made
    once; identity experts; each token's results gathered and summed with
    its weights. No checks, no statistics, no agreement."""

    def __init__(self, world: MPI.Comm, num_experts: int, capacity: int, hidden: int) -> None:
        import torch

        self.world, self.capacity = world, capacity
        size = world.Get_size()
        self.local = num_experts // size
        self.send = torch.zeros(num_experts * capacity, hidden, dtype=torch.bfloat16)
        self.received = torch.zeros(size, self.local, capacity, hidden, dtype=torch.bfloat16)
        self.back = torch.zeros(num_experts * capacity, hidden, dtype=torch.bfloat16)

    def __call__(self, x, experts, weights):
        import torch

        tokens, k = experts.shape
        slots = (experts * self.capacity + torch.arange(tokens)[:, None]).reshape(-1)
        self.send.index_copy_(0, slots, x.repeat_interleave(k, dim=0))
        self.world.Alltoall(self.send.view(torch.int16).numpy(),
                            self.received.view(torch.int16).numpy())
        expert_x = self.received.transpose(0, 1)  # [local experts, source, slot, H]
        expert_y = expert_x.transpose(0, 1).contiguous()  # identity experts, sent back
        self.world.Alltoall(expert_y.view(torch.int16).numpy(),
                            self.back.view(torch.int16).numpy())
        rows = self.back.index_select(0, slots).view(tokens, k, -1)
        return torch.einsum("tk,tkh->th", weights, rows.float()).to(x.dtype)

    def bare(self) -> Callable[[], None]:
        """The same two ``Alltoall`` of the same buffers, nothing else."""
        import torch

        send, back = self.send.view(torch.int16).numpy(), self.back.view(torch.int16).numpy()
        received = self.received.view(torch.int16).numpy()

        def run() -> None:
            self.world.Alltoall(send, received)
            self.world.Alltoall(received, back)
        return run


def _alltoallv_bytes(raw, rows: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
    """mpi4py's ``Alltoallv`` of whole rows, in bytes, counts as Python
    lists (the leanest spelling for a handful of ranks)."""
    row = rows.itemsize * math.prod(rows.shape[1:])
    result = np.empty((sum(recv),) + rows.shape[1:], rows.dtype)
    send_bytes, recv_bytes = [n * row for n in send], [n * row for n in recv]
    raw.Alltoallv([rows, (send_bytes, list(accumulate(send_bytes[:-1], initial=0))), MPI.BYTE],
                  [result, (recv_bytes, list(accumulate(recv_bytes[:-1], initial=0))),
                   MPI.BYTE])
    return result


def counted_exchange(raw, x: np.ndarray, counts: np.ndarray) -> Callable[[], np.ndarray]:
    """What a careful mpi4py caller writes for a variable all-to-all: the
    count exchange (typed, into a buffer kept across calls), the output,
    ``Alltoallv``."""
    received = np.empty_like(counts)

    def run() -> np.ndarray:
        raw.Alltoall([counts, MPI.INT64_T], [received, MPI.INT64_T])
        return _alltoallv_bytes(raw, x, counts.tolist(), received.tolist())
    return run


def there_and_back(raw, rows: np.ndarray, counts: np.ndarray,
                   back_bytes: Optional[int] = None) -> Callable[[], None]:
    """The bare exchange of a dispatch + combine's bytes: the count
    exchange, ``rows`` out, and back (its counts known) what arrived, or
    rows of ``back_bytes`` each (combine returns sums without the ids and
    weights)."""
    received = np.empty_like(counts)

    def run() -> None:
        raw.Alltoall([counts, MPI.INT64_T], [received, MPI.INT64_T])
        there, back = counts.tolist(), received.tolist()
        arrived = _alltoallv_bytes(raw, rows, there, back)
        if back_bytes is not None:  # the first bytes, as rows of back_bytes: no copy
            arrived = arrived.reshape(-1)[:arrived.shape[0] * back_bytes].reshape(-1, back_bytes)
        _alltoallv_bytes(raw, arrived, back, there)
    return run
