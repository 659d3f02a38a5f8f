"""Masks that real training data makes, as ``commlib.sequence.masks.Mask`` values:
what the tests check against SDPA, the solver balances and the benchmarks
time. Each is a function of the sequence length (and its own shape)."""

from __future__ import annotations

from typing import List, Sequence, Tuple

from .masks import Mask, Slice

__all__ = ["prefix_lm", "shared_prefix", "multimodal", "block_diagonal"]


def prefix_lm(length: int, prefix: int) -> Mask:
    """A bidirectional prefix, then causal: every query sees the whole
    prefix; queries past it see the suffix causally (T5 / PaLM prefix-LM)."""
    parts = [Slice((0, prefix), (0, prefix), "full")]
    if prefix < length:
        parts += [Slice((prefix, length), (0, prefix), "full"),
                  Slice((prefix, length), (prefix, length), "causal")]
    return Mask(parts, length=length)


def shared_prefix(length: int, prefix: int, branches: int) -> Mask:
    """A causal shared prompt, then ``branches`` continuations (rejection
    samples, a tree of answers) that each see the prompt and, causally,
    themselves only."""
    parts = [Slice((0, prefix), (0, prefix), "causal")]
    for start, stop in _cuts(prefix, length, branches):
        parts += [Slice((start, stop), (0, prefix), "full"),
                  Slice((start, stop), (start, stop), "causal")]
    return Mask(parts, length=length)


def multimodal(length: int, images: Sequence[Tuple[int, int]]) -> Mask:
    """Causal text with image blocks (``images``: (start, stop) of each):
    every token sees all tokens before it, and an image's tokens see each
    other whole (bidirectional inside the image)."""
    parts: List[Slice] = []
    segments, last = [], 0
    for start, stop in sorted(images):
        segments += [(last, start, "causal"), (start, stop, "full")]
        last = stop
    segments.append((last, length, "causal"))
    for start, stop, kind in segments:
        if start >= stop:
            continue
        if start:
            parts.append(Slice((start, stop), (0, start), "full"))
        parts.append(Slice((start, stop), (start, stop), kind))
    return Mask(parts, length=length)


def block_diagonal(length: int, documents: int, *, causal: bool) -> Mask:
    """``documents`` equal documents, each attending only to itself."""
    return Mask([Slice((start, stop), (start, stop), "causal" if causal else "full")
                 for start, stop in _cuts(0, length, documents)], length=length)


def _cuts(start: int, stop: int, pieces: int) -> List[Tuple[int, int]]:
    """[start, stop) in ``pieces`` near-equal non-empty ranges."""
    edges = [start + (stop - start) * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
