"""Reasoning parsers (`kvserve serve --reasoning-parser NAME`, vLLM's names): each cuts a reasoning
model's output into `reasoning_content` and `content`, one parser per file."""

from __future__ import annotations

from kvserve.engine.errors import ConfigError
from kvserve.service.reasoning.deepseek_r1 import DEEPSEEK_R1
from kvserve.service.reasoning.qwen3 import QWEN3
from kvserve.service.reasoning.think import ThinkParser

REASONING_PARSERS: dict[str, ThinkParser] = {p.name: p for p in (DEEPSEEK_R1, QWEN3)}


def reasoning_parser(name: str | None) -> ThinkParser | None:
    """The parser named `name` (None: none); ConfigError naming the known ones otherwise."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ConfigError(f"unknown --reasoning-parser {name!r}; kvserve has: "
                          f"{', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]
