"""What `mars-ray eval` measures in a set of replies: agreement with references, acceptance per slot and per
draft position."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

from mars_ray.core.decode_state import DecodeResult


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def mean(values: Iterable) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def agreement(texts: Sequence[str], references: Sequence[str]) -> tuple[float, float]:
    """The fraction of texts equal to their reference, and the mean similarity to it."""
    pairs = list(zip(texts, references, strict=True))
    return mean(a == b for a, b in pairs), mean(similarity(a, b) for a, b in pairs)


def acceptance_rates(results: Sequence[DecodeResult], width: int) -> list[float]:
    """Per slot j < width: the fraction of token-producing forwards that accepted more than j tokens."""
    counts = [n for r in results for n in r.accepted]
    return [sum(n > j for n in counts) / max(len(counts), 1) for j in range(width)]


def draft_acceptance(results: Sequence[DecodeResult]) -> list[float]:
    """Verified decoding, per draft position i: of the forwards that checked more than i drafts, the share
    that kept draft i (a forward keeps `accepted - 1` drafts, then adds the greedy token after them). Results
    that do not record their drafts per forward (vLLM's) are left out."""
    recorded = [r for r in results if r.drafted]
    pairs = [(d, a - 1) for r in recorded for d, a in zip(r.drafted, r.accepted, strict=True)]
    width = max((d for d, _ in pairs), default=0)
    rates = []
    for i in range(width):
        offered = [kept for drafted, kept in pairs if drafted > i]
        rates.append(sum(kept > i for kept in offered) / len(offered))
    return rates
