"""A continuation: output tokens a request already generated elsewhere (another replica, before
it died or drained), appended after the prompt as output, so that the engine goes on as an
uninterrupted run would (docs/guides/vllm.md, "Continuations and token ids")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class Continuation:
    """`token_ids`: the choice's output so far; `index`: which choice it is (n > 1 requests are
    continued one choice at a time: the output's `index`, and the seeded draws' sample index)."""

    token_ids: tuple[int, ...]
    index: int = 0

    def check(self, params: Any, vocab_size: int) -> None:
        """InvalidRequestError unless the request samples one choice and the ids are tokens."""
        if params.n != 1 or (params.best_of or 1) != 1:
            raise InvalidRequestError(
                "a continuation continues one choice: send it with n = 1 and no best_of, and "
                "its choice's number as continuation.index", "continuation")
        if self.index < 0:
            raise InvalidRequestError(f"continuation.index must be >= 0, got {self.index}",
                                      "continuation")
        if self.token_ids and (min(self.token_ids) < 0 or max(self.token_ids) >= vocab_size):
            raise InvalidRequestError(
                f"continuation token ids must be in [0, {vocab_size}), got "
                f"{min(self.token_ids)}..{max(self.token_ids)}", "continuation")


def prime(tracker: Any, token_ids: tuple[int, ...] | list[int]) -> int:
    """Feed the continuation to a fresh text tracker one token at a time, as the first run fed
    them, with stop strings off (those tokens were delivered: a stop among them is not looked
    for again); returns the length of the text they made, which the outputs leave out."""
    stop = getattr(tracker, "stop", None)
    if stop:
        tracker.stop = []
    ids: list[int] = []
    for tok in token_ids:
        ids.append(tok)
        tracker.update(ids)
    if stop:
        tracker.stop = stop
    return len(tracker.text)
