"""`--reasoning-parser deepseek_r1`: DeepSeek-R1 and its distills (and QwQ). Their templates open
`<think>` in the prompt, so the output often holds only the closing tag: everything before
`</think>` is reasoning, with or without a `<think>` of its own, and a text that never closes it
is all reasoning."""

from __future__ import annotations

from kvserve.service.reasoning.think import ThinkParser

DEEPSEEK_R1 = ThinkParser("deepseek_r1", implicit_start=True)
