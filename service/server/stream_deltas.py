"""Streaming deltas: what of each choice's cumulative output is new since the last chunk."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sample.sampling_params import SamplingParams


@dataclass
class ChoiceCursor:
    """What was already streamed of one choice: text length and token count; `marks`, the
    (token count, text length) of each output seen since, where a delta may end."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    marks: list[tuple[int, int]] = field(default_factory=list)


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
    stop string that the engine cuts off once it completes. The tokens stay with their text: a
    delta ends where an output the engine made ended (its token count and text length), the
    latest one whose text is not held, so the token ids streamed so far always made exactly the
    text streamed so far (what a continuation elsewhere is primed with, docs/guides/vllm.md).
    Tokens whose text is held go out with it, or with the finish.
    """

    hold: int = 0
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)

    def delta(self, index: int, c: CompletionOutput) -> Delta | None:
        cur = self.cursors.setdefault(index, ChoiceCursor())
        if cur.finished:
            return None
        done = c.finish_reason is not None
        if done:
            num_tokens, end = len(c.token_ids), len(c.text)
        else:
            num_tokens, end = self._release(cur, len(c.token_ids), len(c.text))
        text = c.text[cur.text_len:end]
        if not text and not done:
            return None
        tokens = c.token_ids[cur.num_tokens:num_tokens]
        logprobs = c.logprobs[cur.num_tokens:num_tokens] if c.logprobs is not None else None
        delta = Delta(text, list(tokens), logprobs, c.finish_reason, c.stop_reason, cur.text_len)
        cur.text_len, cur.num_tokens, cur.finished = end, num_tokens, done
        return delta

    def _release(self, cur: ChoiceCursor, num_tokens: int, text_len: int) -> tuple[int, int]:
        """(token count, text length) a running choice's delta may reach: the latest mark
        whose text is out of the held tail (the cursor's own when none is)."""
        if not cur.marks or cur.marks[-1] != (num_tokens, text_len):
            cur.marks.append((num_tokens, text_len))
        limit = text_len - self.hold
        best = (cur.num_tokens, cur.text_len)
        keep = 0
        for i, (n, t) in enumerate(cur.marks):
            if t > limit:
                break
            best, keep = (n, t), i + 1
        del cur.marks[:keep]
        return best


def stop_hold(params: SamplingParams) -> int:
    if params.include_stop_str_in_output or not params.stop_strings:
        return 0
    return max(len(s) for s in params.stop_strings) - 1

