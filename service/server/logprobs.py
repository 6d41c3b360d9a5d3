"""Token texts and the top logprobs of one position, as chat and completion answers show them;
prompt logprobs as vLLM's server writes them."""

from __future__ import annotations

from typing import Any

from kvserve.engine.outputs import Logprob
from kvserve.service.response_models import PromptLogprob, PromptLogprobs

# JSON has no -Infinity: a token the model rules out is shown as OpenAI shows an unlikely one.
MIN_LOGPROB = -9999.0


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_logprobs(tokenizer: Any, entry: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
    """The k most likely tokens of one position, as (text, logprob), best first."""
    best = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]
    return [(token_text(tokenizer, tid), lp.logprob) for tid, lp in best]


def logprob_of(entry: dict[int, Logprob], token_id: int) -> float | None:
    """The logprob of `token_id` at one position (None when the entry lacks it)."""
    found = entry.get(token_id)
    return None if found is None else found.logprob


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None
                         ) -> PromptLogprobs | None:
    """The engine's prompt logprobs as response objects (None stays None)."""
    if entries is None:
        return None
    return [None if e is None else {
        tid: PromptLogprob(logprob=max(lp.logprob, MIN_LOGPROB), rank=lp.rank,
                           decoded_token=lp.decoded_token) for tid, lp in e.items()}
        for e in entries]


def prompt_logprob_values(entries: list[dict[int, Logprob] | None]) -> list[dict[int, Logprob]]:
    """Prompt entries from the second token on (the first has none), JSON-safe, in the shape of
    generated tokens' entries, for echo with logprobs."""
    return [{tid: Logprob(max(lp.logprob, MIN_LOGPROB), lp.rank) for tid, lp in e.items()}
            for e in entries[1:] if e is not None]
