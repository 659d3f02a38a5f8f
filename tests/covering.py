"""Covering arrays: a few cases that still meet every pair of option values.

A product of every option is too many cases to run (the attention matrix
has millions); NIST's combinatorial testing (ACTS) observes that most
faults need only two or three options to meet. ``covering`` builds a list
of cases in which every pair of values of any two factors occurs at least
once, and every combination of the ``full`` groups (say entry point x
layout x method) occurs too, by the greedy AETG construction: each new case
starts from a tuple still uncovered and fills the other factors with the
value that covers most of what is left. The same seed gives the same cases
on every rank and every run.
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Dict, FrozenSet, List, Mapping, Sequence, Set, Tuple

Case = Dict[str, Any]
Item = Tuple[str, Any]


def covering(factors: Mapping[str, Sequence[Any]], *, full: Sequence[Sequence[str]] = (),
             seed: int = 0, tries: int = 20) -> List[Case]:
    """Cases (dicts factor -> value) covering every pair of values of any two
    ``factors`` and every combination of each group of factor names in
    ``full``; deterministic for a ``seed``. ``tries`` candidates are built
    per case and the one covering most wins."""
    for group in full:
        unknown = set(group) - set(factors)
        if unknown:
            raise ValueError(f"full= names factors that do not exist: {sorted(unknown)}")
    rng = random.Random(seed)
    names = list(factors)
    uncovered = _tuples(factors, [pair for pair in itertools.combinations(names, 2)]
                        + [tuple(group) for group in full])
    cases: List[Case] = []
    while uncovered:
        ordered = sorted(uncovered, key=_canonical)
        best, gain = None, -1
        for _ in range(tries):
            case = _grow(dict(rng.choice(ordered)), names, factors, uncovered, rng)
            covered = sum(1 for t in uncovered if _meets(case, t))
            if covered > gain:
                best, gain = case, covered
        cases.append(best)
        uncovered = {t for t in uncovered if not _meets(best, t)}
    return cases


def sample(cases: Sequence[Case], count: int, seed: int = 0) -> List[Case]:
    """``count`` of ``cases`` (all where fewer), the same ones for a seed:
    the quick tier's share of a matrix."""
    if count >= len(cases):
        return list(cases)
    return random.Random(seed).sample(list(cases), count)


def pairs_missed(cases: Sequence[Case], factors: Mapping[str, Sequence[Any]]) -> List[Tuple]:
    """The pairs of values no case meets (empty for a covering array)."""
    wanted = _tuples(factors, list(itertools.combinations(list(factors), 2)))
    return sorted((t for t in wanted if not any(_meets(c, t) for c in cases)), key=_canonical)


def _tuples(factors: Mapping[str, Sequence[Any]],
            groups: Sequence[Sequence[str]]) -> Set[FrozenSet[Item]]:
    return {frozenset(zip(group, values)) for group in groups
            for values in itertools.product(*(factors[name] for name in group))}


def _canonical(wanted: FrozenSet[Item]) -> List[str]:
    """A sort key independent of string hashing, which differs between
    processes (every rank must build the same cases)."""
    return sorted(map(repr, wanted))


def _meets(case: Case, wanted: FrozenSet[Item]) -> bool:
    return all(name in case and case[name] == value for name, value in wanted)


def _grow(case: Case, names: List[str], factors: Mapping[str, Sequence[Any]],
          uncovered: Set[FrozenSet[Item]], rng: random.Random) -> Case:
    """``case`` with every missing factor set, each to the value that
    completes most uncovered tuples given what is set so far."""
    rest = [name for name in names if name not in case]
    rng.shuffle(rest)
    for name in rest:
        scores = []
        for value in factors[name]:
            trial = {**case, name: value}
            scores.append(sum(1 for t in uncovered
                              if (name, value) in t and _meets(trial, t)))
        top = max(scores)
        case[name] = rng.choice([v for v, s in zip(factors[name], scores) if s == top])
    return {name: case[name] for name in names}
