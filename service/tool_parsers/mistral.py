"""`--tool-call-parser mistral`: the calls are `[TOOL_CALLS]` (a special token) then a JSON list
`[{"name": ..., "arguments": {...}}, ...]`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.service.tool_parsers.base import ToolParser

_SYSTEM = (
    "You can call these functions: {tools}. To call functions, answer with [TOOL_CALLS] followed "
    'by a JSON list of calls: [TOOL_CALLS][{{"name": <function-name>, "arguments": '
    "<args-dict>}}]")


@dataclass(frozen=True)
class MistralParser(ToolParser):
    def render(self, calls: list[tuple[str, Any]]) -> str:
        return self.opener + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                        ensure_ascii=False)


MISTRAL = MistralParser("mistral", "[TOOL_CALLS]", _SYSTEM, needs_special_tokens=True)
