"""Speculative-decoding counters (vLLM's spec_decode_* figures) and the periodic log line with
the acceptance rate and the mean acceptance length."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("kvserve.engine")
LOG_INTERVAL_S = 10.0


@dataclass
class SpecCounters:
    """Cumulative since start: drafts (requests that got at least one draft token in a step),
    draft tokens scored, drafts accepted, and accepted drafts by position (0 = first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    def copy(self) -> "SpecCounters":
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            list(self.accepted_per_pos))


def log_line(now: SpecCounters, before: SpecCounters, seconds: float) -> str:
    """vLLM's "SpecDecoding metrics" line over an interval (`before` -> `now`)."""
    drafts = now.num_drafts - before.num_drafts
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    per_pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
               for i, a in enumerate(now.accepted_per_pos)]
    rates = ", ".join(f"{a / drafts:.3f}" for a in per_pos) if drafts else ""
    mean_len = 1 + accepted / drafts if drafts else 0.0
    rate = 100.0 * accepted / drafted if drafted else 0.0
    return (f"SpecDecoding metrics: Mean acceptance length: {mean_len:.2f}, Accepted "
            f"throughput: {accepted / max(seconds, 1e-9):.2f} tokens/s, Drafted throughput: "
            f"{drafted / max(seconds, 1e-9):.2f} tokens/s, Accepted: {accepted} tokens, "
            f"Drafted: {drafted} tokens, Per-position acceptance rate: {rates}, Avg Draft "
            f"acceptance rate: {rate:.1f}%")


class SpecLogger:
    """Logs the line every LOG_INTERVAL_S seconds while drafts are being scored."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = SpecCounters()
        self._t = time.monotonic()

    def maybe_log(self, counters: SpecCounters) -> str | None:
        now = time.monotonic()
        if now - self._t < self.interval_s or counters.num_drafts == self._last.num_drafts:
            return None
        line = log_line(counters, self._last, now - self._t)
        logger.info("%s", line)
        self._last, self._t = counters.copy(), now
        return line
