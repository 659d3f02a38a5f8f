"""Pick the Ulysses degree (and so the ring size) for an attention shape.

Neither scheme wins everywhere. Per rank and forward pass, Ring moves about
2 * N * h_kv * d bytes (K and V of the whole sequence, whatever P is) in P-1
point-to-point hops, and merges a partial result at every hop; Ulysses moves
about (2h + 2h_kv) * N * d / P bytes in all-to-alls that do not overlap, and
needs at least P query heads (a degree that does not divide them costs as
much as the rank with the most heads, to which every chunk is padded). Which is
cheaper depends on the head counts against the degree and on which traffic
the fabric carries better, so the planner measures the fabric once (a short
probe, cached per communicator) and prices every allowed degree.

The ring across groups can also gather K and V once instead
(``method="allgather"``): the same bytes in one collective that nothing
overlaps, but no merge per hop and one or two kernel calls per query chunk.
Both are priced; the plan names the cheaper.

Ring hops overlap with compute only where something moves the data while
the cores compute: NCCL on a GPU. Over MPI on the host, a transfer advances
only inside MPI calls and its copies need the same cores as the compute, so
there the hops are priced as exposed.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import numpy as np

from ..kernels.tiled import attention_forward
from ..ulysses.relayout import divisors, padded_heads

_fabrics: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PROBE_SMALL, _PROBE_LARGE = 256, 2**20  # bytes per peer
_MERGE_PASSES = 6  # array passes of merge_into over the running output


@dataclass(frozen=True)
class Fabric:
    """What the probe measured: latency (s) and bandwidth (bytes/s per rank)
    of an all-to-all and of a ring hop, and the local kernel's flop rate."""

    alltoall_latency: float
    alltoall_bandwidth: float
    hop_latency: float
    hop_bandwidth: float
    flops: float
    memory_bandwidth: float  # bytes/s of an array copy: packing, unpacking, merging
    overlap: bool = False    # whether ring hops hide behind compute (NCCL)

    def describe(self) -> str:
        return (f"all-to-all {self.alltoall_latency * 1e6:.0f} us + "
                f"{self.alltoall_bandwidth / 1e9:.2f} GB/s per rank, ring hop "
                f"{self.hop_latency * 1e6:.0f} us + {self.hop_bandwidth / 1e9:.2f} GB/s "
                f"({'overlapped' if self.overlap else 'exposed'}), kernel "
                f"{self.flops / 1e9:.1f} GFLOP/s, copies {self.memory_bandwidth / 1e9:.1f} GB/s "
                f"per rank")


@dataclass(frozen=True)
class Candidate:
    ulysses_size: int
    ring_size: int
    ulysses_bytes: float   # per rank, forward
    ring_bytes: float      # per rank, forward
    compute_s: float
    ulysses_s: float   # all-to-alls, packing and unpacking
    ring_s: float      # exposed hops (or the all-gather) and the merges
    method: str = "ring"

    @property
    def seconds(self) -> float:
        return self.compute_s + self.ulysses_s + self.ring_s


@dataclass(frozen=True)
class Plan:
    """The planner's pick: ``ulysses_size`` x ``ring_size`` = world size,
    the ring run as ``method`` ("ring" or "allgather")."""

    ulysses_size: int
    ring_size: int
    predicted_seconds: float
    candidates: List[Candidate] = field(repr=False)
    rejected: List[str] = field(repr=False)
    fabric: Fabric = field(repr=False)
    method: str = "ring"

    def explain(self) -> str:
        lines = [f"Ulysses {c.ulysses_size} x Ring {c.ring_size}"
                 f"{_by(c.method, c.ring_size)}: moves "
                 f"{c.ulysses_bytes / 2**20:.1f} MiB all-to-all + {c.ring_bytes / 2**20:.1f} MiB "
                 f"ring per rank, predicted {c.seconds * 1e3:.1f} ms (compute "
                 f"{c.compute_s * 1e3:.1f}, all-to-all {c.ulysses_s * 1e3:.1f}, ring "
                 f"{c.ring_s * 1e3:.1f})" for c in self.candidates]
        rejected = f" Not allowed: {'; '.join(self.rejected)}." if self.rejected else ""
        return (f"Picked Ulysses {self.ulysses_size} x Ring {self.ring_size}"
                f"{_by(self.method, self.ring_size)} "
                f"({self.predicted_seconds * 1e3:.1f} ms predicted per forward). "
                + " ".join(f"{line}." for line in lines) + rejected
                + f" Fabric: {self.fabric.describe()}.")


def _by(method: str, ring: int) -> str:
    return " by all-gather" if method == "allgather" and ring > 1 else ""


def _timed(comm, call, repeats: int = 3) -> float:
    """Slowest rank's best time of ``call``."""
    best = float("inf")
    for _ in range(repeats):
        comm.barrier()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return float(comm.allreduce(np.array([best]), op="max")[0])


def probe(comm) -> Fabric:
    """Measure the fabric under ``comm`` (collective; cached per communicator)."""
    if comm in _fabrics:
        return _fabrics[comm]
    size = comm.size
    small = np.zeros(size * _PROBE_SMALL, np.uint8)
    large = np.zeros(size * _PROBE_LARGE, np.uint8)
    t_small = _timed(comm, lambda: comm.alltoall(small))
    t_large = _timed(comm, lambda: comm.alltoall(large))
    moved = _PROBE_LARGE * max(size - 1, 1)
    h_small = _timed(comm, lambda: comm.ring_shift(small[:_PROBE_SMALL]))
    h_large = _timed(comm, lambda: comm.ring_shift(large[:_PROBE_LARGE]))
    # long enough (tens of ms) that ranks sharing a core show it
    q = np.random.default_rng(0).standard_normal((1, 1024, 4, 64), dtype=np.float32)
    t_kernel = _timed(comm, lambda: attention_forward(q, q, q), repeats=2)
    block = np.zeros(4 * 2**20 // 4, np.float32)
    t_copy = _timed(comm, lambda: block.copy())
    fabric = Fabric(t_small, moved / max(t_large - t_small, 1e-9), h_small,
                    _PROBE_LARGE / max(h_large - h_small, 1e-9),
                    4 * 1024 * 1024 * 4 * 64 / t_kernel, block.nbytes / t_copy,
                    comm.backend == "nccl")
    _fabrics[comm] = fabric
    return fabric


def price(size: int, degree: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
          itemsize: int, causal: bool, fabric: Fabric, method: str = "ring") -> Candidate:
    """The cost model of Ulysses ``degree`` x Ring ``size // degree``, the
    ring run as ``method``."""
    ring = size // degree
    token = head_dim * itemsize
    # heads of the busiest rank, to which every all-to-all chunk is padded
    local, local_kv = padded_heads(heads, degree, heads), padded_heads(kv_heads, degree, heads)
    # all-to-all: q, k, v in and out back, each rank keeping 1/degree of it
    relaid = (2 * local + 2 * local_kv) * degree * (seq_len / size) * token
    ulysses_bytes = relaid * (degree - 1) / degree
    ulysses_s = (2 * fabric.alltoall_latency + ulysses_bytes / fabric.alltoall_bandwidth
                 + 2 * relaid / fabric.memory_bandwidth) if degree > 1 else 0.0
    # ring: K and V of each of the other ring ranks' spans, kv heads of this group
    hop_bytes = 2 * (seq_len / ring) * local_kv * token
    ring_bytes = hop_bytes * (ring - 1)
    work = 4 * seq_len * seq_len * local * head_dim / ring / fabric.flops
    if causal:  # Ulysses is balanced; a contiguous ring's last rank does R - 1/2 of R blocks
        work *= 0.5 if ring == 1 else (ring - 0.5) / ring
    # each merge reads and writes the float32 running output a few times
    output = (seq_len / ring) * local * head_dim * 4
    merge = _MERGE_PASSES * output / fabric.memory_bandwidth
    if method == "allgather":  # one exposed collective (an all-to-all's rate); a merge at most
        gather = (fabric.alltoall_latency + ring_bytes / fabric.alltoall_bandwidth
                  if ring > 1 else 0.0)
        return Candidate(degree, ring, ulysses_bytes, ring_bytes, work, ulysses_s,
                         gather + (merge if ring > 1 else 0.0), method)
    per_hop = fabric.hop_latency + hop_bytes / fabric.hop_bandwidth
    hops = (ring - 1) * (max(0.0, per_hop - work / ring) if fabric.overlap else per_hop)
    return Candidate(degree, ring, ulysses_bytes, ring_bytes, work, ulysses_s,
                     hops + (ring - 1) * merge)


def plan(comm, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
         itemsize: int = 2, causal: bool = False, fabric: Optional[Fabric] = None,
         methods: Sequence[str] = ("ring", "allgather")) -> Plan:
    """The cheapest allowed Ulysses x Ring split of ``comm`` for this shape,
    and the cheaper of ``methods`` for its ring, by the cost model over the
    probed (or given) fabric. A ``seq_len`` the world size does not divide
    is priced padded (``cu_seqlens`` pads it)."""
    fabric = fabric or probe(comm)
    padded = -(-seq_len // comm.size) * comm.size
    candidates, rejected = [], []
    for degree in divisors(comm.size):
        if num_heads < degree:
            rejected.append(f"Ulysses {degree} ({num_heads} heads leave a rank without one)")
            continue
        for method in (methods if degree < comm.size else methods[:1]):
            candidates.append(price(comm.size, degree, padded, num_heads, num_kv_heads,
                                    head_dim, itemsize, causal, fabric, method))
    if not candidates:
        raise ValueError("no Ulysses x Ring split fits: " + "; ".join(rejected))
    best = min(candidates, key=lambda c: c.seconds)
    return Plan(best.ulysses_size, best.ring_size, best.seconds, candidates, rejected, fabric,
                best.method)
