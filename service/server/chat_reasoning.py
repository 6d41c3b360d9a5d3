"""`--reasoning-parser` in /v1/chat/completions: a splitter per choice made from the request (its
chat_template_kwargs, the end of its prompt, whether a grammar writes the output), and the split
of a whole answer or of one streamed delta. Tool calls are parsed from the content part only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.reasoning.think import ReasoningSplitter, ThinkParser

# prompt tokens decoded to see whether the template opened a think block (Qwen3-2507)
PROMPT_TAIL_TOKENS = 16

Splitters = Callable[[], "ReasoningSplitter | None"]


def reasoning_splitters(parser: ThinkParser | None, tokenizer: Any, prompt: list[int],
                        template_kwargs: dict[str, Any] | None,
                        params: SamplingParams) -> Splitters | None:
    """What makes each choice's splitter; None without --reasoning-parser. Keeps the think tags
    in the text when the tokenizer counts them as special tokens."""
    if parser is None:
        return None
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    if parser.start in special or parser.end in special:
        params.skip_special_tokens = False
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    constrained = params.structured_outputs is not None
    return lambda: parser.splitter(tail, template_kwargs, constrained)


def split_whole(make: Splitters | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished choice; content "" when there is none."""
    splitter = make() if make is not None else None
    if splitter is None:
        return None, text
    splitter.feed(text)
    splitter.finish()
    reasoning, content = splitter.result()
    return reasoning, content or ""


def split_delta(splitter: ReasoningSplitter, text: str, finished: bool) -> tuple[str, str]:
    """(reasoning, content) to send for one streamed delta (what was held back, at the end)."""
    reasoning, content = splitter.feed(text)
    if finished:
        more_r, more_c = splitter.finish()
        reasoning, content = reasoning + more_r, content + more_c
    return reasoning, content
