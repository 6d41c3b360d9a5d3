"""Reasoning split by think tags: a model writes `<think>reasoning</think>content`, and a
`ReasoningSplitter` cuts its text, whole or as it streams, into reasoning and content.

The splitter holds back only a tail that could still grow into a tag, so the reasoning and content
it streams, joined, are exactly what it gives for the whole text. A text cut short inside the
reasoning (no closing tag yet) is all reasoning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PRE, THINKING, CONTENT = "pre", "thinking", "content"


@dataclass
class ReasoningSplitter:
    """One choice's split. `pre`: no tag seen yet (text there is reasoning when the start tag is
    implied, content otherwise); `thinking`: after the start tag; `content`: after the end tag,
    where nothing more is parsed."""

    start: str
    end: str
    implicit_start: bool  # text before the end tag is reasoning even without the start tag
    anchored: bool = False  # the start tag counts only at the start of the output
    state: str = PRE
    pending: str = ""  # text not yet handed out: a tail that may be the beginning of a tag
    reasoning: list[str] = field(default_factory=list)  # everything handed out, for `result`
    content: list[str] = field(default_factory=list)

    def _watched(self) -> tuple[str, ...]:
        if self.state == PRE:
            return (self.start, self.end) if self.implicit_start else (self.start,)
        return (self.end,) if self.state == THINKING else ()

    def _in_reasoning(self) -> bool:
        return self.state == THINKING or (self.state == PRE and self.implicit_start)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that became safe to send with `delta`; either may be ""."""
        self.pending += delta
        reasoning, content = [], []
        if self.state == PRE and self.anchored:
            head = self.pending.lstrip()
            if not head.startswith(self.start):
                if self.start.startswith(head):  # may still become the start tag
                    return self._keep("", "")
                self.state = CONTENT
        while True:
            out = reasoning if self._in_reasoning() else content
            tags = self._watched()
            hits = [(self.pending.find(t), t) for t in tags if t in self.pending]
            if not hits:
                keep = _partial_tag(self.pending, tags)
                out.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            at, tag = min(hits)
            out.append(self.pending[:at])
            self.pending = self.pending[at + len(tag):]
            self.state = THINKING if tag == self.start else CONTENT
        return self._keep("".join(reasoning), "".join(content))

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text is complete."""
        rest, self.pending = self.pending, ""
        return self._keep(rest, "") if self._in_reasoning() else self._keep("", rest)

    def _keep(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning.append(reasoning)
        self.content.append(content)
        return reasoning, content

    def result(self) -> tuple[str | None, str | None]:
        """(reasoning, content) of everything fed so far, None for an empty part."""
        return "".join(self.reasoning) or None, "".join(self.content) or None


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    for k in range(min(max((len(t) for t in tags), default=1) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-k:]) for t in tags):
            return k
    return 0


@dataclass(frozen=True)
class ThinkParser:
    """A `--reasoning-parser` for a family that marks its reasoning with think tags."""

    name: str
    implicit_start: bool
    start: str = "<think>"
    end: str = "</think>"

    def splitter(self, prompt_tail: str = "", template_kwargs: dict[str, Any] | None = None,
                 constrained: bool = False) -> ReasoningSplitter | None:
        """A splitter for one choice; None when the request's output holds no reasoning.
        `prompt_tail` is the end of the rendered prompt, `template_kwargs` the request's
        chat_template_kwargs. `constrained`: a grammar (response_format, a required or named
        tool_choice) writes the whole output, so only a `<think>` that begins it opens
        reasoning (a JSON string holding the tags stays content)."""
        return ReasoningSplitter(self.start, self.end, self.implicit_start and not constrained,
                                 anchored=constrained)

    def split(self, text: str, prompt_tail: str = "",
              template_kwargs: dict[str, Any] | None = None,
              constrained: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished text."""
        splitter = self.splitter(prompt_tail, template_kwargs, constrained)
        if splitter is None:
            return None, text or None
        splitter.feed(text)
        splitter.finish()
        return splitter.result()
