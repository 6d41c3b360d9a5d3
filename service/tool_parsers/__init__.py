"""Tool-call parsers (`--tool-call-parser`, vLLM's names), one format per file: where a model's
calls begin in its text, how one call reads, and how a template that knows no tools is told the
format. base.py holds what they share (`ToolParser`, `ObjectScanner`, `call_of`)."""

from __future__ import annotations

from kvserve.service.tool_parsers.base import ObjectScanner, ToolParser, call_of
from kvserve.service.tool_parsers.hermes import HERMES
from kvserve.service.tool_parsers.llama3_json import LLAMA3_JSON
from kvserve.service.tool_parsers.mistral import MISTRAL
from kvserve.service.tool_parsers.xlam import XLAM

TOOL_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HERMES, MISTRAL, LLAMA3_JSON, XLAM)}
DEFAULT_TOOL_PARSER = "hermes"

__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "ObjectScanner", "ToolParser", "call_of"]
