"""Request fields OpenAI or vLLM define that this server does not implement.

Each is refused with a 400 naming it, unless its value asks for nothing (the table's predicate):
a client that sends `use_beam_search: false` gets what it asked for, one that relies on a
feature we lack is told so instead of silently getting something else. Fields nobody knows are
still ignored (service/request_models.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from kvserve.engine.errors import InvalidRequestError

Harmless = Callable[[Any, Any], bool]  # (value, request) -> True when the value asks for nothing


def asks_nothing(value: Any, _: Any = None) -> bool:
    """A value that turns a feature off: absent, null, false, an empty list, object or string."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def refuse_unsupported(req: BaseModel, table: dict[str, Harmless], prefix: str = "") -> None:
    """400 naming the first known-but-unsupported field set to a value that asks for something."""
    for name, harmless in table.items():
        value = getattr(req, name)
        if not harmless(value, req):
            raise InvalidRequestError(
                f"{prefix}{name} is not supported by this server (got {json.dumps(value)[:80]}); "
                "remove it from the request", param=f"{prefix}{name}")


# Known to OpenAI or vLLM for both completions and chat completions.
# (use_beam_search and length_penalty run there: service/beam_request.py)
SAMPLING_UNSUPPORTED: dict[str, Harmless] = {
    "early_stopping": asks_nothing,
    "guided_whitespace_pattern": asks_nothing,
    "allowed_token_ids": asks_nothing,
    "bad_words": asks_nothing,
    "truncate_prompt_tokens": lambda v, _: v is None,
    "logits_processors": asks_nothing,
    "return_tokens_as_token_ids": asks_nothing,
    "store": asks_nothing,
    "service_tier": lambda v, _: v in (None, "auto", "default"),
}
# The token-level route (/inference/v1/generate) runs no beam search, as vLLM's.
GENERATE_UNSUPPORTED: dict[str, Harmless] = {
    "use_beam_search": asks_nothing,
    "length_penalty": lambda v, _: v is None or v == 1.0,
    **SAMPLING_UNSUPPORTED,
}

