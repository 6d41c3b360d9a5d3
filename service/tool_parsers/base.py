"""What every tool-call format shares: `ToolParser` (where the calls begin in a text, how much of
a growing text is surely no call, how earlier calls render) and `ObjectScanner`.

Every format writes each call as one JSON object `{"name": ..., "arguments"|"parameters": {...}}`
after an opener, so one scanner finds the calls: each outermost JSON object after the opener,
complete once it closes, which is what lets a stream send each call as soon as it is written."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolParser:
    """One model family's tool-call format: a subclass per format renders earlier calls."""

    name: str
    opener: str  # the text that starts the calls
    system: str  # instructions (with {tools}) for a chat template that knows no tools
    bare_json: bool = False  # a text that begins with `{` is a call too (llama3_json)
    needs_special_tokens: bool = False  # the opener is a special token: keep it in the text

    def start(self, text: str) -> int:
        """Where the calls begin in `text`; -1 when they do not (yet)."""
        found = text.find(self.opener)
        if found >= 0:
            return found
        stripped = text.lstrip()
        if self.bare_json and stripped.startswith("{"):
            return len(text) - len(stripped)
        return -1

    def safe_prefix(self, text: str) -> int:
        """How much of `text` is surely not part of a call: up to the opener, or a tail that
        could still become one (and, for bare JSON, nothing while only whitespace came)."""
        start = self.start(text)
        if start >= 0:
            return start
        if self.bare_json and not text.strip():
            return 0
        for k in range(min(len(self.opener) - 1, len(text)), 0, -1):
            if self.opener.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls (name, arguments) as the model would have written them."""
        raise NotImplementedError

    def tool_result(self, content: str) -> str:
        """A tool's result as the model reads it."""
        return content


def call_of(obj_text: str) -> tuple[str, Any] | None:
    """(name, arguments) of one call object, or None when it is not one."""
    try:
        obj = json.loads(obj_text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args


@dataclass
class ObjectScanner:
    """Finds each outermost JSON object in a growing text, once it closes (strings and escapes
    respected); resumes where the last scan stopped, so a stream scans each character once."""

    pos: int = 0
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    begin: int = -1

    def scan(self, text: str) -> list[str]:
        found = []
        for i in range(self.pos, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"' and self.depth:
                self.in_string = True
            elif ch == "{":
                if self.depth == 0:
                    self.begin = i
                self.depth += 1
            elif ch == "}" and self.depth:
                self.depth -= 1
                if self.depth == 0:
                    found.append(text[self.begin:i + 1])
        self.pos = max(self.pos, len(text))
        return found
