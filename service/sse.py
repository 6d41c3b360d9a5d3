"""Server-sent events as the OpenAI API streams them: `data: <json>` events ending in `[DONE]`.

Once a stream has started its status line is sent, so a failure is reported in-band as one event
holding OpenAI's error body (the openai client raises APIError on it); server and router both
use `sse_error` for that."""

from __future__ import annotations

import json

from pydantic import BaseModel

from kvserve.service.openai_errors import error_body

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict | str) -> str:
    """One event holding `payload` (a pydantic model, a dict or already-encoded JSON)."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


def sse_error(status: int, message: str, code: str | None = None) -> str:
    """One event holding the error body of `status` (the stream's own status is already sent)."""
    return sse(error_body(status, message, code=code))
