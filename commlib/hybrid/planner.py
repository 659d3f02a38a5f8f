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

Where the communicator spans hosts there are two fabrics, and the probe
measures both: inside a host (the ranks of each host among themselves) and
across hosts (one rank per host, every rank of a host crossing at once, and
one rank per host alone: whether the ranks of a host share one link or each
has its own). Each candidate's Ulysses groups and rings are priced by the
fabric they span, read from the rank -> group mapping of ``hybrid_attention``
(``attention.colors``) and the communicator's topology: Ulysses groups of
consecutive ranks stay inside a host when the degree divides the ranks per
host (USP's placement), and the ring across the groups then crosses hosts.

The ring across groups can also gather K and V once instead
(``method="allgather"``): the same bytes in one collective that nothing
overlaps, but no merge per hop and one or two kernel calls per query chunk.
Both are priced; the plan names the cheaper.

With a mask (``commlib.sequence.masks.Mask``) the compute is the visible (query,
key) pairs of the busiest ring rank, its tokens placed as
``hybrid_attention`` places them (the layout over every rank, a ring rank
holding its Ulysses group's shards), so a layout that leaves a mask's work
uneven is priced uneven; Ulysses alone (the whole sequence on every rank)
does every pair. The ring's sparse exchange (``method="sparse"``,
``commlib.ring.sparse``) is then priced too: one exposed all-to-all, as the
all-gather, of only the K and V rows the busiest rank's queries see.

Ring hops overlap with compute only where something moves the data while
the cores compute: NCCL on a GPU. Over MPI on the host, a transfer advances
only inside MPI calls and its copies need the same cores as the compute, so
there the hops are priced as exposed.
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..kernels.tiled import attention_forward
from ..ring.sparse import routes
from ..sequence.balanced import loads, placement_for
from ..sequence.documents import Grouped
from ..sequence.masks import Mask, check_mask
from ..topology import Topology
from ..ulysses.relayout import divisors, padded_heads
from .attention import colors

_fabrics: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PROBE_SMALL = 256  # bytes per peer
# (large message in bytes per peer, samples of each size): the next rung is
# measured only when the large message was not told apart from the small one,
# or took too short a time (below)
_PROBE_LADDER = ((2**16, 5), (2**20, 7), (2**23, 9))
# a large message that takes less is measured larger again while a rung is
# left: where cores are shared, each handshake of a message can wait a
# scheduler tick (a millisecond or more), and a rate read off a few ticks
# is the ticks'
_PROBE_LONG_ENOUGH_S = 10e-3
_PROBE_BUFFER_LIMIT = 2**26  # bytes an all-to-all probe sends per rank, at most
_NOISE_DEVIATIONS = 3  # a time difference counts when above 3 median absolute deviations
_MERGE_PASSES = 6  # array passes of merge_into over the running output
_BACKWARD_WORK = 2.5  # backward kernel flops over the forward's (FlashAttention's count)
_GRADIENT_BYTES = 4  # dK and dV travel in float32
_clock = time.perf_counter


@dataclass(frozen=True)
class Link:
    """One kind of transfer as probed: ``latency`` (s) + bytes / ``bandwidth``
    (bytes/s per rank). ``resolved`` False: the largest probe message was not
    measurably slower than the smallest (less than twice its time, or within
    the noise), so ``bandwidth`` is only the lower bound that the probe
    shows (inf where the timings had no spread at all): not the bottleneck
    at the sizes probed, and priced at that bound."""

    latency: float
    bandwidth: float
    resolved: bool = True

    def seconds(self, nbytes: float, calls: int = 1) -> float:
        """``calls`` transfers that move ``nbytes`` per rank between them."""
        return calls * self.latency + (nbytes / self.bandwidth if nbytes else 0.0)

    def describe(self) -> str:
        largest = f"{_PROBE_LADDER[-1][0] // 2**20} MiB per peer"
        rate = (_rate(self.bandwidth) if self.resolved else
                f"bandwidth not measurable ({largest} no slower than {_PROBE_SMALL} B)"
                if math.isinf(self.bandwidth) else
                f">= {_rate(self.bandwidth)} (not the bottleneck: {largest} was not "
                f"measurably slower than {_PROBE_SMALL} B)")
        return f"{self.latency * 1e6:.0f} us + {rate}"


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s" if bytes_per_s >= 1e9 else \
        f"{bytes_per_s / 1e6:.1f} MB/s"


@dataclass(frozen=True)
class Across:
    """The links between hosts. ``alltoall`` and ``hop``: per rank, probed
    over one rank per host with every rank of a host (``ranks_per_host``)
    crossing at once; ``hop_alone``: one rank per host crossing alone."""

    alltoall: Link
    hop: Link
    hop_alone: Link
    ranks_per_host: int

    def hop_bandwidth(self, crossing: int) -> float:
        """Per rank, with ``crossing`` ranks of a host sending across at once:
        at most what one rank alone gets, and all of them together at most
        what the host's ranks got together (a shared link gives each of
        fewer ranks more; a link per rank gives each the same)."""
        return min(self.hop_alone.bandwidth,
                   self.hop.bandwidth * self.ranks_per_host / max(crossing, 1))

    def describe(self) -> str:
        return (f"all-to-all {self.alltoall.describe()} per rank, ring hop "
                f"{self.hop.describe()} per rank ({self.ranks_per_host} ranks of a host "
                f"crossing at once), {self.hop_alone.describe()} for one alone")


@dataclass(frozen=True)
class Fabric:
    """What the probe measured: latency (s) and bandwidth (bytes/s per rank)
    of an all-to-all and of a ring hop inside a host (the whole
    communicator on one host), the local kernel's flop rate and the copy
    rate; ``across``: the links between hosts (None on one host);
    ``bounds``: which of "all-to-all" and "ring hop" inside a host have
    only a lower bound for their bandwidth (``Link.resolved``)."""

    alltoall_latency: float
    alltoall_bandwidth: float
    hop_latency: float
    hop_bandwidth: float
    flops: float
    memory_bandwidth: float  # bytes/s of an array copy: packing, unpacking, merging
    overlap: bool = False    # whether ring hops hide behind compute (NCCL)
    across: Optional[Across] = None
    bounds: Tuple[str, ...] = ()

    @property
    def alltoall(self) -> Link:
        return Link(self.alltoall_latency, self.alltoall_bandwidth, "all-to-all" not in self.bounds)

    @property
    def hop(self) -> Link:
        return Link(self.hop_latency, self.hop_bandwidth, "ring hop" not in self.bounds)

    def describe(self) -> str:
        inside = (f"all-to-all {self.alltoall.describe()} per rank, ring hop "
                  f"{self.hop.describe()} ({'overlapped' if self.overlap else 'exposed'})")
        where = "," if self.across is None else \
            f" inside a host; across hosts: {self.across.describe()};"
        return (f"{inside}{where} kernel {self.flops / 1e9:.1f} GFLOP/s, copies "
                f"{self.memory_bandwidth / 1e9:.1f} GB/s per rank")


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
    ulysses_span: str = "inside a host"  # or "across hosts": the fabric the groups span
    ring_span: str = "inside a host"

    @property
    def seconds(self) -> float:
        return self.compute_s + self.ulysses_s + self.ring_s

    def label(self, spans: bool) -> str:
        """"Ulysses u x Ring r", and where ``spans`` the fabric each spans."""
        where = [f"{name} {span}" for name, degree, span in
                 (("Ulysses", self.ulysses_size, self.ulysses_span),
                  ("ring", self.ring_size, self.ring_span)) if spans and degree > 1]
        return (f"Ulysses {self.ulysses_size} x Ring {self.ring_size}"
                f"{_by(self.method, self.ring_size)}"
                + (f" ({', '.join(where)})" if where else ""))


@dataclass(frozen=True)
class SplitPlan:
    """The planner's pick, the split of the ranks between Ulysses and the
    ring: ``ulysses_size`` x ``ring_size`` = world size, the ring run as
    ``method`` ("ring", "allgather" or "sparse"); priced per forward, or per
    forward and backward where ``backward``."""

    ulysses_size: int
    ring_size: int
    predicted_seconds: float
    candidates: List[Candidate] = field(repr=False)
    rejected: List[str] = field(repr=False)
    fabric: Fabric = field(repr=False)
    method: str = "ring"
    backward: bool = False

    def explain(self) -> str:
        spans = any("across hosts" in (c.ulysses_span, c.ring_span) for c in self.candidates)
        picked = next(c for c in self.candidates
                      if (c.ulysses_size, c.method) == (self.ulysses_size, self.method))
        lines = [f"{c.label(spans)}: moves "
                 f"{c.ulysses_bytes / 2**20:.1f} MiB all-to-all + {c.ring_bytes / 2**20:.1f} MiB "
                 f"ring per rank per forward, predicted {c.seconds * 1e3:.1f} ms (compute "
                 f"{c.compute_s * 1e3:.1f}, all-to-all {c.ulysses_s * 1e3:.1f}, ring "
                 f"{c.ring_s * 1e3:.1f})" for c in self.candidates]
        rejected = f" Not allowed: {'; '.join(self.rejected)}." if self.rejected else ""
        return (f"Picked {picked.label(spans)} ({self.predicted_seconds * 1e3:.1f} ms predicted "
                f"per forward{' and backward' if self.backward else ''}). "
                + " ".join(f"{line}." for line in lines) + rejected
                + f" Fabric: {self.fabric.describe()}.")


def _by(method: str, ring: int) -> str:
    by = {"allgather": " by all-gather", "sparse": " by sparse exchange"}
    return by.get(method, "") if ring > 1 else ""


# -- the probe ------------------------------------------------------------------------
def _probe_samples(world, calls: Sequence[Optional[Callable[[], object]]], samples: int,
             warm_up: bool = True) -> np.ndarray:
    """[samples, calls] seconds: per sample, each call's time on the slowest
    rank of ``world``. The calls alternate within each sample (drift hits
    them alike), each from a barrier of ``world`` (sub-communicators probed
    at once load their links at once); one allreduce at the end, so every
    rank decides on the same numbers. A rank whose call is None idles."""
    times = np.zeros((samples, len(calls)))
    for sample in range(-1 if warm_up else 0, samples):
        for i, call in enumerate(calls):
            world.barrier()
            if call is not None:
                start = _clock()
                call()
                if sample >= 0:
                    times[sample, i] = _clock() - start
    return np.asarray(world.allreduce(times, op="max"))


def _link(world, transfer: Optional[Callable[[int], Callable[[], object]]],
          moved: Callable[[int], float]) -> Link:
    """Latency and bandwidth of ``transfer(bytes_per_peer)`` (None on ranks
    that idle), which moves ``moved(bytes_per_peer)`` bytes per rank: the
    medians of interleaved samples of a small and a large message. Where
    the large one is not told apart (less than twice the small one's time,
    or within the noise) or took under ``_PROBE_LONG_ENOUGH_S``, a larger
    message and more samples are measured; past the last rung a bandwidth
    not told apart is only a lower bound (``Link``)."""
    for large, samples in _PROBE_LADDER:
        calls = [None, None] if transfer is None else [transfer(_PROBE_SMALL), transfer(large)]
        times = _probe_samples(world, calls, samples)
        small_s, large_s = np.median(times, axis=0)
        noise = float(np.max(np.median(np.abs(times - [small_s, large_s]), axis=0)))
        gap, threshold = large_s - small_s, max(_NOISE_DEVIATIONS * noise, small_s)
        carried = moved(large) - moved(_PROBE_SMALL)
        if gap > threshold and (large_s >= _PROBE_LONG_ENOUGH_S
                                or large == _PROBE_LADDER[-1][0]):
            return Link(float(small_s), float(carried / gap))
    return Link(float(small_s), float(carried / threshold) if threshold > 0 else math.inf, False)


def _hop_of(comm) -> Optional[Callable[[int], Callable[[], object]]]:
    """Ring hops of a message of n bytes over ``comm`` (None: none)."""
    if comm is None:
        return None

    def transfer(per_peer: int) -> Callable[[], object]:
        send = np.zeros(per_peer, np.uint8)
        return lambda: comm.ring_shift(send)
    return transfer


def _links(world, comm, peers: int) -> Tuple[Link, Link]:
    """(all-to-all, ring hop) of ``comm`` (None: this rank idles), all of
    whose copies across ``world`` are probed at once; ``peers``: the size
    of the largest of them, by which bytes are counted (one rank alone
    copies to itself)."""
    def capped(per_peer: int) -> int:
        return min(per_peer, _PROBE_BUFFER_LIMIT // peers)

    def alltoall(per_peer: int) -> Callable[[], object]:
        send = np.zeros(comm.size * capped(per_peer), np.uint8)
        return lambda: comm.alltoall(send)

    return (_link(world, None if comm is None else alltoall,
                  lambda per_peer: capped(per_peer) * max(peers - 1, 1)),
            _link(world, _hop_of(comm), float))


def _across_hosts(comm, topology: Topology) -> Tuple[Optional[Tuple[Link, Link]], Across]:
    """The links inside hosts (None when no host has two ranks) and across
    them; collective. Sub-communicators of ``comm``, freed before returning:
    each host's ranks, and the ranks of each local rank (one per host)."""
    sizes = [len(topology.ranks_of(n)) for n in range(topology.num_nodes)]
    host = comm.split(topology.node, key=comm.rank, backend="mpi")
    peers = comm.split(topology.local_rank, key=comm.rank, backend="mpi")
    try:
        inside = _links(comm, host if host.size > 1 else None, max(sizes)) \
            if max(sizes) > 1 else None
        alltoall, hop = _links(comm, peers if peers.size > 1 else None, topology.num_nodes)
        alone = _link(comm, _hop_of(peers if topology.local_rank == 0 else None), float)
    finally:
        peers.free()
        host.free()
    return inside, Across(alltoall, hop, alone, max(sizes))


def probe(comm) -> Fabric:
    """Measure the fabric under ``comm`` (collective; cached per
    communicator). Every decision, the re-measuring included, is taken on
    allreduced numbers, so every rank takes the same ones and returns the
    same Fabric."""
    if comm in _fabrics:
        return _fabrics[comm]
    topology = comm.topology
    if topology.num_nodes == 1:
        inside, across = _links(comm, comm, comm.size), None
    else:
        inside, across = _across_hosts(comm, topology)
        if inside is None:  # no two ranks share a host: every exchange crosses
            inside = (across.alltoall, across.hop)
    alltoall, hop = inside
    # long enough (tens of ms) that ranks sharing a core show it
    q = np.random.default_rng(0).standard_normal((1, 1024, 4, 64), dtype=np.float32)
    t_kernel = np.median(_probe_samples(comm, [lambda: attention_forward(q, q, q, False)], 3,
                                        False))
    block = np.zeros(4 * 2**20 // 4, np.float32)
    t_copy = np.median(_probe_samples(comm, [block.copy], 5))
    bounds = tuple(name for name, link in (("all-to-all", alltoall), ("ring hop", hop))
                   if not link.resolved)
    fabric = Fabric(alltoall.latency, alltoall.bandwidth, hop.latency, hop.bandwidth,
                    4 * 1024 * 1024 * 4 * 64 / t_kernel, block.nbytes / t_copy,
                    comm.backend == "nccl", across, bounds)
    _fabrics[comm] = fabric
    return fabric


# -- the cost model --------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """Where a degree's groups sit: the most group (ring) peers a rank has
    on other hosts, and the most ranks of one host whose ring successor is
    on another host (0: the ring stays inside hosts)."""

    ulysses_remote: int
    ring_remote: int
    ring_crossing: int

    @classmethod
    def of(cls, topology: Topology, degree: int) -> "Spread":
        node = topology.node_of_rank
        ulysses: dict = {}
        rings: dict = {}
        for rank in range(topology.size):  # members in rank order, as groups() splits
            group, ring = colors(rank, degree)
            ulysses.setdefault(group, []).append(rank)
            rings.setdefault(ring, []).append(rank)

        def remote(groups: dict) -> int:
            return max(sum(node[peer] != node[rank] for peer in members)
                       for members in groups.values() for rank in members)

        crossing = [0] * topology.num_nodes
        for ring in rings.values():
            for rank, successor in zip(ring, ring[1:] + ring[:1]):
                crossing[node[rank]] += node[successor] != node[rank]
        return cls(remote(ulysses), remote(rings), max(crossing))


def exchange_seconds(fabric: Fabric, members: int, remote: int, per_peer: float,
                     calls: int) -> float:
    """``calls`` all-to-alls that send ``per_peer`` bytes between them to
    each of a group's other ``members - 1`` ranks, ``remote`` of them on
    other hosts: the bytes across hosts and those inside go at once."""
    if remote == 0 or fabric.across is None:
        return fabric.alltoall.seconds(per_peer * (members - 1), calls)
    inside = members - 1 - remote
    return max(fabric.across.alltoall.seconds(per_peer * remote, calls),
               fabric.alltoall.seconds(per_peer * inside, calls) if inside else 0.0)


def _hop(fabric: Fabric, crossing: int, nbytes: float) -> float:
    """A ring step moving ``nbytes`` per rank: it lasts as long as its
    slowest hop, one across hosts where ``crossing`` ranks of a host cross."""
    if crossing == 0 or fabric.across is None:
        return fabric.hop.seconds(nbytes)
    return fabric.across.hop.latency + nbytes / fabric.across.hop_bandwidth(crossing)


def _check_masked(mask: Optional[Mask], causal: bool, methods: Sequence[str]) -> None:
    """A mask carries its own causality, and the sparse exchange's routes
    come from the mask alone."""
    if mask is None:
        if "sparse" in methods:
            raise ValueError('method "sparse" (the ring\'s sparse exchange) is priced from a '
                             'mask: pass mask= (a commlib.sequence.masks.Mask), or price "ring" '
                             'and "allgather"')
        return
    check_mask(mask, None)
    if causal:
        raise ValueError("pass causal=True or mask=, not both: a mask carries its own causality "
                         "(the causal one: commlib.sequence.masks.from_cu_seqlens([0, L], "
                         "causal=True))")


def _pairs(mask: Mask, placement: Any, ring: int) -> float:
    """Visible pairs of the busiest ring rank: all of them on one."""
    return float(mask.pairs_in((0, mask.length)) if ring == 1 else loads(mask, placement).max())


def price(size: int, degree: int, seq_len: int, num_heads: int, num_kv_heads: int,
          head_dim: int, itemsize: int, fabric: Fabric, method: str = "ring", *,
          causal: bool, layout: str, mask: Optional[Mask] = None,
          topology: Optional[Topology] = None, backward: bool = False,
          latent_width: Optional[int] = None) -> Candidate:
    """The cost model of Ulysses ``degree`` x Ring ``size // degree``, the
    ring run as ``method`` over shards in ``layout``, its groups placed as
    ``hybrid_attention`` places them on ``topology`` (None: one host); per
    forward, or per forward and backward where ``backward``. With ``mask``
    (of ``seq_len`` tokens, or of fewer that ``seq_len`` pads to a multiple
    of ``size``) the compute is its busiest ring rank's visible pairs. With
    ``latent_width`` (r + d_rope of multi-head latent attention) a pure ring
    moves each token's latent instead of its K and V and expands every block
    it receives (``commlib.ring.latent``); Ulysses splits heads, so a split
    with Ulysses moves them expanded."""
    _check_masked(mask, causal, (method,))
    if mask is not None and seq_len not in (mask.length, -(-mask.length // size) * size):
        raise ValueError(f"the mask covers {mask.length} tokens but seq_len is {seq_len}: make "
                         f"the mask for the global sequence (Mask(slices, length=seq_len))")
    ring = size // degree
    # the ring's ranks hold their Ulysses groups' shards, as hybrid_attention's ring does
    placement = None if mask is None or ring == 1 else \
        Grouped(placement_for(layout, size, None, mask=mask), degree)
    spread = Spread.of(topology or Topology(0, (0,) * size), degree)
    token = head_dim * itemsize
    # heads of the busiest rank, to which every all-to-all chunk is padded
    local = padded_heads(num_heads, degree, num_heads)
    local_kv = padded_heads(num_kv_heads, degree, num_heads)
    # all-to-all: q, k, v in and out back, each rank keeping 1/degree of it
    # (the backward: q, k, v, dout, out in and dq, dk, dv back, twice the bytes)
    relaid = (2 * local + 2 * local_kv) * degree * (seq_len / size) * token
    ulysses_bytes = relaid * (degree - 1) / degree
    ulysses_s = (exchange_seconds(fabric, degree, spread.ulysses_remote, relaid / degree, 2)
                 + 2 * relaid / fabric.memory_bandwidth) if degree > 1 else 0.0
    # ring: K and V of each of the other ring ranks' spans, kv heads of this group
    hop_bytes = 2 * (seq_len / ring) * local_kv * token
    gradient_bytes = hop_bytes * _GRADIENT_BYTES / itemsize
    latent = latent_width is not None and degree == 1 and method in ("ring", "allgather")
    if latent:  # the latent travels; each rank expands the whole sequence's K and V
        hop_bytes = (seq_len / ring) * latent_width * itemsize
        gradient_bytes = hop_bytes * _GRADIENT_BYTES / itemsize
    ring_bytes = hop_bytes * (ring - 1)
    # an exchange's bytes to each peer: a shard, or the busiest rank's needed rows among them
    per_peer = hop_bytes
    if method == "sparse" and ring > 1:
        received = max(routes(mask, placement).received(r) for r in range(ring))
        ring_bytes = 2 * received * local_kv * token
        per_peer = ring_bytes / (ring - 1)
    if mask is not None:
        work = 4 * _pairs(mask, placement, ring) * local * head_dim / fabric.flops
    else:
        work = 4 * seq_len * seq_len * local * head_dim / ring / fabric.flops
    if causal:  # Ulysses and zigzag rings are balanced; a contiguous ring's last rank
        # does R - 1/2 of R blocks
        work *= 0.5 if ring == 1 or layout != "contiguous" else (ring - 0.5) / ring
    if latent:  # K and V of every head, from the latent: two products over the sequence
        work += 2 * 2 * seq_len * latent_width * local * head_dim / fabric.flops
    passes = 1 + _BACKWARD_WORK if backward else 1
    # each merge reads and writes the float32 running output a few times
    output = (seq_len / ring) * local * head_dim * 4
    merge = _MERGE_PASSES * output / fabric.memory_bandwidth
    spans = ("across hosts" if spread.ulysses_remote else "inside a host",
             "across hosts" if spread.ring_crossing else "inside a host")
    if backward:  # twice the forward's bytes and all-to-alls
        ulysses_s *= 3
    if ring == 1:
        ring_s = 0.0
    elif method in ("allgather", "sparse"):
        # one exposed collective (an all-to-all's rate); a merge at most
        ring_s = exchange_seconds(fabric, ring, spread.ring_remote, per_peer, 1) + merge
        if backward:  # K and V again, dK and dV back to their owners (an all-to-all)
            gradient = per_peer * _GRADIENT_BYTES / itemsize
            ring_s += exchange_seconds(fabric, ring, spread.ring_remote, per_peer + gradient, 2)
    else:
        def exposed(seconds: float, step_work: float) -> float:
            return max(0.0, seconds - step_work) if fabric.overlap else seconds

        per_hop = _hop(fabric, spread.ring_crossing, hop_bytes)
        ring_s = (ring - 1) * (exposed(per_hop, work / ring) + merge)
        if backward:  # K and V around again, and dK, dV one hop behind them, home at the end
            step = _BACKWARD_WORK * work / ring
            both = _hop(fabric, spread.ring_crossing, hop_bytes + gradient_bytes)
            ring_s += (ring - 1) * exposed(both, step) + \
                exposed(_hop(fabric, spread.ring_crossing, gradient_bytes), step)
    return Candidate(degree, ring, ulysses_bytes, ring_bytes, work * passes, ulysses_s,
                     ring_s, method, *spans)


def plan(comm, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
         itemsize: int = 2, *, causal: bool, layout: str, mask: Optional[Mask] = None,
         methods: Optional[Sequence[str]] = None, backward: bool = False,
         fabric: Optional[Fabric] = None, latent_width: Optional[int] = None) -> SplitPlan:
    """The cheapest allowed Ulysses x Ring split of ``comm`` for this shape,
    and the cheapest of ``methods`` for its ring (None: "ring" and
    "allgather", and "sparse" with a mask), by the cost model over the
    probed (or given) fabric and ``comm.topology``; per forward, or per
    forward and backward (training) where ``backward``; the causal work of
    a ring balanced unless ``layout`` is "contiguous"; with ``mask`` (of
    ``seq_len`` tokens, instead of ``causal``), its visible pairs. A
    ``seq_len`` the world size does not divide is priced padded
    (``cu_seqlens`` pads it). ``latent_width``: r + d_rope of multi-head
    latent attention, whose pure ring moves the latent (``price``)."""
    if methods is None:
        methods = ("ring", "allgather") if mask is None else ("ring", "allgather", "sparse")
    _check_masked(mask, causal, methods)
    if mask is not None:
        check_mask(mask, seq_len)
    fabric = fabric or probe(comm)
    padded = -(-seq_len // comm.size) * comm.size
    candidates, rejected = [], []
    for degree in divisors(comm.size):
        if num_heads < degree:
            rejected.append(f"Ulysses {degree} ({num_heads} heads leave a rank without one)")
            continue
        for method in (methods if degree < comm.size else methods[:1]):
            candidates.append(price(comm.size, degree, padded, num_heads, num_kv_heads,
                                    head_dim, itemsize, fabric, method, causal=causal,
                                    layout=layout, mask=mask, topology=comm.topology,
                                    backward=backward, latent_width=latent_width))
    if not candidates:
        raise ValueError("no Ulysses x Ring split fits: " + "; ".join(rejected))
    best = min(candidates, key=lambda c: c.seconds)
    return SplitPlan(best.ulysses_size, best.ring_size, best.seconds, candidates, rejected, fabric,
                best.method, backward)
