"""Streaming deltas: what of each choice's cumulative output is new since the last chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sample.sampling_params import SamplingParams


@dataclass
class ChoiceCursor:
    """What was already streamed of one choice: text length and token count."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    offset: int  # characters streamed before this delta


@dataclass
class StreamTracker:
    """Turns cumulative CompletionOutputs into deltas, one cursor per choice index.

    While a choice runs, the last `hold` characters are held back: they could be the start of a
    stop string that the engine cuts off once it completes.
    """

    hold: int = 0
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)

    def delta(self, index: int, c: CompletionOutput) -> Delta | None:
        cur = self.cursors.setdefault(index, ChoiceCursor())
        if cur.finished:
            return None
        done = c.finish_reason is not None
        end = len(c.text) if done else max(len(c.text) - self.hold, cur.text_len)
        text = c.text[cur.text_len:end]
        tokens = c.token_ids[cur.num_tokens:]
        logprobs = c.logprobs[cur.num_tokens:] if c.logprobs is not None else None
        if not text and not done:
            return None
        delta = Delta(text, list(tokens), logprobs, c.finish_reason, c.stop_reason, cur.text_len)
        cur.text_len, cur.num_tokens, cur.finished = end, len(c.token_ids), done
        return delta


def stop_hold(params: SamplingParams) -> int:
    if params.include_stop_str_in_output or not params.stop_strings:
        return 0
    return max(len(s) for s in params.stop_strings) - 1

