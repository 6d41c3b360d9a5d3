"""`--reasoning-parser qwen3`: Qwen3 writes `<think>...</think>` itself, so only text after a
`<think>` is reasoning (text without one is content). `chat_template_kwargs: {"enable_thinking":
false}` turns thinking off in Qwen3's template, and the whole output is content. A template that
opens `<think>` in the prompt itself (Qwen3-2507 thinking models) starts the output inside the
reasoning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.service.reasoning.think import THINKING, ReasoningSplitter, ThinkParser


@dataclass(frozen=True)
class Qwen3Parser(ThinkParser):
    def splitter(self, prompt_tail: str = "", template_kwargs: dict[str, Any] | None = None,
                 constrained: bool = False) -> ReasoningSplitter | None:
        if (template_kwargs or {}).get("enable_thinking", True) is False:
            return None
        splitter = ReasoningSplitter(self.start, self.end, implicit_start=False,
                                     anchored=constrained)
        opened = prompt_tail.rfind(self.start)
        if opened >= 0 and self.end not in prompt_tail[opened:] and not constrained:
            splitter.state = THINKING
        return splitter


QWEN3 = Qwen3Parser("qwen3", implicit_start=False)
