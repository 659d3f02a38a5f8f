"""What each rank of a multi-rank launch ran, read from the junit XML that
tests/mpi_pytest.py writes (LOGDIR/rank<r>.xml), and which of its skips may
pass unseen.

A launch that exits 0 is no evidence by itself: a file that skipped at
import, or a probe that turned an error into a skip, exits 0 too. A skip
passes only where its reason is on ``ALLOWED_SKIPS`` at that world size.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ElementTree
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import pytest


@dataclass(frozen=True)
class AllowedSkip:
    """Skips whose reason matches ``pattern`` (``re.search``) are expected
    at the world sizes ``at`` accepts."""

    label: str
    pattern: str
    at: Callable[[int], bool]


ALLOWED_SKIPS = (
    # tests/cuda_probe.py, on a machine without a GPU
    AllowedSkip("no GPU", r"^no CUDA device here", lambda size: True),
    # the CUDA-aware path of tests/mpi/test_staged.py
    AllowedSkip("MPI not CUDA-aware", r"^MPI is not CUDA-aware here", lambda size: True),
    # the lowest-versions job: a feature the installed framework is too old for
    AllowedSkip("older framework", r"^(torch|jax|transformers) \S+ has no ", lambda size: True),
    # what ranks disagree on, or what a peer does, cannot happen alone
    AllowedSkip("one rank", r"two ranks|a rank to|a peer|peers|one rank|divides by 1",
                lambda size: size == 1),
    AllowedSkip("odd world", r"two emulated nodes|an even number of ranks",
                lambda size: size % 2 == 1),
    AllowedSkip("under 4 ranks", r"needs 4 ranks", lambda size: size < 4),
)

# test_multirank's per-launch lines, printed by tests/conftest.py at the end
SUMMARY_KEY = pytest.StashKey[List[str]]()


@dataclass
class RankOutcomes:
    """One rank's report: counts, and each skip as (test, reason)."""

    passed: int = 0
    failed: int = 0  # failures and errors
    skips: List[Tuple[str, str]] = field(default_factory=list)

    @property
    def ran(self) -> int:
        return self.passed + self.failed + len(self.skips)


def read_rank(path: Path) -> RankOutcomes:
    """The outcomes in one junit XML file."""
    outcomes = RankOutcomes()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        children = {child.tag: child for child in case}
        if "failure" in children or "error" in children:
            outcomes.failed += 1
        elif "skipped" in children:
            outcomes.skips.append((test, _skip_reason(children["skipped"])))
        else:
            outcomes.passed += 1
    return outcomes


def _skip_reason(skipped: ElementTree.Element) -> str:
    message = skipped.get("message", "")
    if skipped.get("type") == "pytest.xfail":
        return f"xfail: {message}"
    if message == "collection skipped":  # a whole file, skipped at import
        return f"collection skipped: {skipped.text}"
    return message


def allowed(reason: str, world_size: int) -> Optional[AllowedSkip]:
    """The entry of ``ALLOWED_SKIPS`` that lets ``reason`` skip at ``world_size``."""
    for entry in ALLOWED_SKIPS:
        if entry.at(world_size) and re.search(entry.pattern, reason):
            return entry
    return None


def read_launch(logdir: Path, world_size: int) -> List[Optional[RankOutcomes]]:
    """Each rank's outcomes, None for a rank that wrote no report."""
    paths = [logdir / f"rank{rank}.xml" for rank in range(world_size)]
    return [read_rank(path) if path.exists() else None for path in paths]


def problems(ranks: Sequence[Optional[RankOutcomes]]) -> List[str]:
    """Why a launch is no evidence even where it exited 0: a rank with no
    report, a rank that ran no test, a skip not allowed at this world size."""
    found = []
    for rank, outcomes in enumerate(ranks):
        if outcomes is None:
            found.append(f"rank {rank} wrote no junit report")
        elif outcomes.ran == 0:
            found.append(f"rank {rank} ran no test")
        else:
            found += [f"rank {rank}: {test} skipped: {reason}"
                      for test, reason in outcomes.skips if allowed(reason, len(ranks)) is None]
    return found


def summary(name: str, ranks: Sequence[Optional[RankOutcomes]]) -> str:
    """One line: what ran at this launch, per rank where the ranks differ."""
    counts = [_counts(outcomes, len(ranks)) for outcomes in ranks]
    if len(set(counts)) == 1:
        each = "its one rank" if len(ranks) == 1 else f"each of {len(ranks)} ranks"
        return f"{name}: {counts[0]}, on {each}"
    return f"{name}: " + "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(counts))


def _counts(outcomes: Optional[RankOutcomes], world_size: int) -> str:
    if outcomes is None:
        return "no report"
    labels = Counter(getattr(allowed(reason, world_size), "label", "NOT ALLOWED")
                     for _, reason in outcomes.skips)
    why = ", ".join(f"{label} {count}" for label, count in sorted(labels.items()))
    return (f"{outcomes.passed} passed, {outcomes.failed} failed, {len(outcomes.skips)} skipped"
            + (f" ({why})" if why else ""))
