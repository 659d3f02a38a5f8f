"""``--slow-links``: time every pair of ranks alone and name what is slow, a
host, a rank or a link, each link judged against the fastest of its kind
(inside a host, between hosts)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np

import commlib
from commlib.topology import Topology

LINK_BYTES = 1024 ** 2
LINK_ITERS = 5
# --slow-links: a link is slow when it takes over this many times the fastest
# link of its kind (the fastest is never slow, so it stands for a healthy one)
SLOW_FACTOR = 2.0
# the kinds of link: between ranks of one host, between ranks of two hosts (also
# the names of the parts of a Row sent apart)
INSIDE, BETWEEN = "inside", "between"
# --slow-links names at most this many single slow links (the matrix has them all)
_MAX_LINKS_NAMED = 5


def time_links(comm: commlib.Communicator, nbytes: int = LINK_BYTES,
               iters: int = LINK_ITERS) -> np.ndarray:
    """[size, size] seconds for ``nbytes`` each way between ranks i and j,
    the best of ``iters``, while the other ranks send nothing. Each pair is
    one alltoallv with counts for that pair only, so a slow link stands out
    instead of being averaged into the full exchange; O(size^2) small calls."""
    times = np.zeros((comm.size, comm.size), dtype=np.float64)
    payload = np.zeros(nbytes, dtype=np.uint8)
    for i in range(comm.size):
        for j in range(i + 1, comm.size):
            counts = np.zeros(comm.size, dtype=np.int64)
            if comm.rank in (i, j):
                counts[j if comm.rank == i else i] = nbytes
            send = payload if comm.rank in (i, j) else payload[:0]
            times[i, j] = times[j, i] = _best_exchange(comm, send, counts, iters)
    return comm.allreduce(times, op="max")


def _best_exchange(comm: commlib.Communicator, send: np.ndarray, counts: np.ndarray,
                   iters: int) -> float:
    """The fastest of ``iters`` barrier-started exchanges, as this rank saw it
    (idle ranks see ~0 and lose the "max" reduction to the pair)."""
    best = float("inf")
    for _ in range(iters):
        comm.barrier()
        start = time.perf_counter()
        comm.alltoallv(send, counts, counts)
        best = min(best, time.perf_counter() - start)
    return best


def link_kinds(topology: Topology) -> Dict[str, np.ndarray]:
    """[P, P] masks of the links of each kind: between two ranks of one host
    (INSIDE), between ranks of two hosts (BETWEEN); a rank's copy to itself
    is neither."""
    nodes = np.asarray(topology.node_of_rank)
    same = nodes[:, None] == nodes[None, :]
    return {INSIDE: same & ~np.eye(len(nodes), dtype=bool), BETWEEN: ~same}


@dataclass(frozen=True)
class Culprit:
    """What --slow-links names: a host (``kind`` "host": a node and its
    ranks), a rank (its node too) or a link (two ranks, ``node`` None), and
    ``ratio``, the median over its slow links of their time over the median
    healthy link of the same kind."""

    kind: str
    ranks: Tuple[int, ...]
    node: Optional[int]
    ratio: float

    def as_json(self) -> dict:
        """The culprit for --json."""
        return {"kind": self.kind, "ranks": list(self.ranks), "node": self.node,
                "ratio": self.ratio}


@dataclass(frozen=True, eq=False)  # arrays: no meaningful ==
class SlowLinks:
    """--slow-links' verdict on [P, P] link times (seconds): ``slow`` marks
    the links over ``factor`` x the fastest of their kind, ``typical`` is the
    median of each kind's healthy links (None: no link of that kind), and
    ``culprits`` explain the slow links, widest cause first."""

    times: np.ndarray
    node_of_rank: Tuple[int, ...]
    factor: float
    slow: np.ndarray
    typical: Dict[str, Optional[float]]
    culprits: Tuple[Culprit, ...]

    def as_json(self) -> dict:
        """The links for --json: the matrix (0 on the diagonal) and the
        verdict, so that both can be drawn."""
        return {"bytes": LINK_BYTES, "iters": LINK_ITERS, "factor": self.factor,
                "node_of_rank": list(self.node_of_rank),
                "time_us": (self.times * 1e6).tolist(), "slow": self.slow.tolist(),
                "typical_us": {kind: None if time is None else time * 1e6
                               for kind, time in self.typical.items()},
                "culprits": [culprit.as_json() for culprit in self.culprits]}


def attribute_slow_links(times: np.ndarray, topology: Topology,
                         factor: float = SLOW_FACTOR) -> SlowLinks:
    """Which host, rank or link makes the slow links slow, from the times
    alone. A link is slow over ``factor`` x the fastest link of its kind
    (inside a host, between hosts: shared memory and the network differ),
    not over the median: a slow host owns 2 of the 3 links of 3 hosts.
    Then, widest first: a host whose every link to other hosts is slow (of
    two hosts, never: the fastest link between them is not); a rank, not
    alone on its host, whose every link is slow; the slow links neither
    explains, one by one, slowest first."""
    kinds = link_kinds(topology)
    slow = np.zeros(times.shape, dtype=bool)
    ratio = np.zeros(times.shape)
    typical: Dict[str, Optional[float]] = {}
    for kind, mask in kinds.items():
        typical[kind] = None
        if mask.any():
            slow |= mask & (times > factor * times[mask].min())
            typical[kind] = float(np.median(times[mask & ~slow]))
            ratio[mask] = times[mask] / typical[kind]
    culprits = []
    explained = np.zeros(times.shape, dtype=bool)

    def name(kind: str, links: np.ndarray, ranks: Tuple[int, ...], node: int) -> None:
        if links.any() and slow[links].all():
            culprits.append(Culprit(kind, ranks, node, float(np.median(ratio[links]))))
            explained[links] = True

    nodes = np.asarray(topology.node_of_rank)
    for node in range(topology.num_nodes):
        on_node = nodes == node
        name("host", kinds[BETWEEN] & (on_node[:, None] | on_node[None, :]),
             topology.ranks_of(node), node)
    for rank in range(topology.size):
        if len(topology.ranks_of(topology.node_of(rank))) > 1:
            touching = np.zeros(times.shape, dtype=bool)
            touching[rank, :] = touching[:, rank] = True
            name("rank", touching & ~np.eye(topology.size, dtype=bool), (rank,),
                 topology.node_of(rank))
    single = sorted(zip(*np.nonzero(np.triu(slow & ~explained))),
                    key=lambda link: -ratio[link])
    culprits += [Culprit("link", (int(i), int(j)), None, float(ratio[i, j]))
                 for i, j in single]
    return SlowLinks(times, tuple(topology.node_of_rank), factor, slow, typical,
                     tuple(culprits))


def slow_link_lines(links: SlowLinks) -> List[str]:
    """The link matrix in microseconds, '-' on the diagonal, slow links
    starred, and below it what is slow, or that nothing is."""
    times = links.times
    size = len(times)
    lines = [f"# slow links: {LINK_BYTES} B each way between each pair, best of "
             f"{LINK_ITERS}, time (us)",
             f"# * slow: over {links.factor:g}x the fastest link of its kind (inside a "
             f"host, between hosts)",
             "#  src\\dst" + "".join(f"{j:>11}" for j in range(size))]
    if size < 2:
        return lines + ["# no links in a world of one"]
    for i in range(size):
        cells = ["-" if i == j else f"{times[i, j] * 1e6:.1f}" + ("*" if links.slow[i, j]
                 else " ") for j in range(size)]
        lines.append(f"  {i:>8}" + "".join(f"{cell:>11}" for cell in cells))
    if not links.culprits:
        return lines + [f"# no slow links: none takes over {links.factor:g}x the fastest "
                        f"link of its kind"]
    single = [culprit for culprit in links.culprits if culprit.kind == "link"]
    lines += [_culprit_line(culprit, links) for culprit in links.culprits
              if culprit.kind != "link"]
    lines += [_culprit_line(culprit, links) for culprit in single[:_MAX_LINKS_NAMED]]
    if len(single) > _MAX_LINKS_NAMED:
        lines.append(f"# ... and {len(single) - _MAX_LINKS_NAMED} more slow links "
                     f"(starred above)")
    return lines


def _culprit_line(culprit: Culprit, links: SlowLinks) -> str:
    """One culprit named, with how much slower than healthy its links are."""
    ranks = ", ".join(map(str, culprit.ranks))
    slower = f"{culprit.ratio:.1f}x slower than the median healthy link"
    if culprit.kind == "host":
        return (f"# slow host node{culprit.node} (rank{'s' if len(culprit.ranks) > 1 else ''} "
                f"{ranks}): its links to other hosts {slower} between hosts")
    if culprit.kind == "rank":
        return f"# slow rank {ranks} (on node{culprit.node}): its links {slower}"
    i, j = culprit.ranks
    kind = "inside a host" if links.node_of_rank[i] == links.node_of_rank[j] \
        else "between hosts"
    return f"# slow link: {i} <-> {j}, {links.times[i, j] * 1e6:.1f} us, {slower} {kind}"
