"""Caps on one request, checked at the edge by the server and the router alike."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request, checked at the edge (server and router); each is a CLI flag."""

    max_json_depth: int = 32  # --max-json-depth: nesting of arrays/objects in the body
    max_prompts: int = 64  # --max-prompts-per-request: prompts in one /v1/completions body
    max_prompt_tokens: int = 131072  # --max-prompt-tokens-per-request: all prompts together
    max_n: int = 16  # --max-n
    max_stop: int = 16  # --max-stop: entries of `stop`, and of `stop_token_ids`
    max_stop_len: int = 256  # --max-stop-length: characters of one stop string
    max_logprobs: int = 20  # --max-logprobs: `logprobs` / `top_logprobs` (20 is OpenAI's cap)


DEFAULT_LIMITS = RequestLimits()


def check_prompt_tokens(counts: list[int], limits: RequestLimits, param: str = "prompt") -> None:
    """400 when the prompts of one request hold more tokens in all than the cap."""
    total = sum(counts)
    if total > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"the prompts of this request hold {total} tokens; at most "
            f"{limits.max_prompt_tokens} are allowed in one request "
            "(--max-prompt-tokens-per-request)", param=param)

