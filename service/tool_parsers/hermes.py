"""`--tool-call-parser hermes` (the default; Qwen, SmolLM2, Hermes): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a tool's result `<tool_response>`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.service.tool_parsers.base import ToolParser

_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools> {tools} </tools> For each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>')


@dataclass(frozen=True)
class HermesParser(ToolParser):
    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.opener}\n" + json.dumps({"name": n, "arguments": a},
                                                        ensure_ascii=False) + "\n</tool_call>"
                         for n, a in calls)

    def tool_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


HERMES = HermesParser("hermes", "<tool_call>", _SYSTEM)
