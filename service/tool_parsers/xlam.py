"""`--tool-call-parser xlam` (Salesforce xLAM-2): the calls are one JSON list `[{"name": ...,
"arguments": {...}}, ...]`, written bare, in a ```json fence, after `[TOOL_CALLS]`, inside
`<tool_call>...</tool_call>`, or right after `</think>`; text before the calls is content.

A stream needs to know early whether a tail may still become such an opener (a fence may be
```` ```json ```` then a newline before its `[`), so each opener is a short pattern that a
text can match whole, match in part up to its end, or miss."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.service.tool_parsers.base import ToolParser

_SYSTEM = (
    "You can call these functions: {tools}. To call functions, answer only with a JSON list of "
    'calls: [{{"name": <function-name>, "arguments": <args-dict>}}, ...]')

# An opener is a list of (kind, text): "lit" must come, "opt" may come, "ws" is any whitespace.
_FENCE = (("lit", "```"), ("opt", "json"), ("ws", ""), ("lit", "["))
_TOOL_CALLS = (("lit", "[TOOL_CALLS]"),)
_TAG = (("lit", "<tool_call>"),)
_THINK = (("lit", "</think>"), ("ws", ""), ("lit", "["))  # the calls begin after </think>
_BARE = (("ws", ""), ("lit", "["))  # only at the very start of the text
_FIRST_CHARS = re.compile(r"[`\[<]")
FULL, PARTIAL = 2, 1


def _match(text: str, i: int, opener: tuple[tuple[str, str], ...]) -> int:
    """FULL when `text` at i holds the whole opener, PARTIAL when it runs out while still
    matching it, 0 when it cannot be this opener."""
    j = i
    for kind, part in opener:
        if kind == "ws":
            while j < len(text) and text[j].isspace():
                j += 1
        elif text.startswith(part, j):
            j += len(part)
        elif j < len(text) and part.startswith(text[j:]):
            return PARTIAL
        elif kind == "lit":
            return PARTIAL if j == len(text) else 0
    return FULL


@dataclass(frozen=True)
class XlamParser(ToolParser):
    def _first(self, text: str, partial: bool) -> int:
        """Where the first opener begins (with `partial`, one that may still grow into one)."""
        wanted = (FULL, PARTIAL) if partial else (FULL,)
        if _match(text, 0, _BARE) in wanted:
            return 0
        for m in _FIRST_CHARS.finditer(text):
            i = m.start()
            for opener in (_FENCE, _TOOL_CALLS, _TAG, _THINK):
                found = _match(text, i, opener)
                if found in wanted:
                    if opener is _THINK and found == FULL:
                        return i + len("</think>")
                    return i
        return -1

    def start(self, text: str) -> int:
        return self._first(text, partial=False)

    def safe_prefix(self, text: str) -> int:
        held = self._first(text, partial=True)
        return len(text) if held < 0 else held

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


XLAM = XlamParser("xlam", "[TOOL_CALLS]", _SYSTEM)
