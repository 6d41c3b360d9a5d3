"""Same-run ratios with their spread: one ratio per round (kvserve's run over the peer's run of the
same round), then the median and the range over the rounds. Standard library only."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    median: float
    lo: float
    hi: float
    rounds: int

    def text(self, unit: str = "x", digits: int = 2) -> str:
        """`1.31x (1.22-1.40, 3 rounds)`; one round has no range to show."""
        head = f"{self.median:.{digits}f}{unit}"
        if self.rounds == 1:
            return f"{head} (1 round)"
        return f"{head} ({self.lo:.{digits}f}-{self.hi:.{digits}f}, {self.rounds} rounds)"


def spread(values: list[float]) -> Spread:
    if not values:
        raise ValueError("no rounds to summarise")
    return Spread(statistics.median(values), min(values), max(values), len(values))


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Round by round: ours[i] / theirs[i]. A round missing on either side is an error, not a
    silently shorter list (zip(strict=True))."""
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def ratio_spread(ours: list[float], theirs: list[float]) -> Spread:
    return spread(paired_ratios(ours, theirs))


def order_of_round(i: int) -> tuple[str, str]:
    """Who runs first in round i: kvserve in even rounds, vLLM in odd ones, so a machine that
    speeds up or slows down across a round favours neither side on average."""
    return ("kvserve", "vllm") if i % 2 == 0 else ("vllm", "kvserve")
