"""`--tool-call-parser llama3_json`: `<|python_tag|>{...}; {...}` or a text that begins with a bare
JSON object, each `{"name": ..., "parameters": {...}}`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvserve.service.tool_parsers.base import ToolParser

_SYSTEM = (
    "You have access to these functions: {tools}. To call a function, respond only with a JSON "
    'object of the form {{"name": <function-name>, "parameters": <args-dict>}}; separate several '
    "calls with '; '.")


@dataclass(frozen=True)
class Llama3JsonParser(ToolParser):
    def render(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)


LLAMA3_JSON = Llama3JsonParser("llama3_json", "<|python_tag|>", _SYSTEM, bare_json=True,
                               needs_special_tokens=True)
