"""Token texts and the top logprobs of one position, as chat and completion answers show them."""

from __future__ import annotations

from typing import Any


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_logprobs(tokenizer: Any, entry: dict[int, float], k: int) -> list[tuple[str, float]]:
    """The k most likely tokens of one position, as (text, logprob), best first."""
    best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return [(token_text(tokenizer, tid), lp) for tid, lp in best]
