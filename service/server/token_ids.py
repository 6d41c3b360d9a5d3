"""vLLM's `return_token_ids`: a choice, or stream chunk, carries the token ids of its text
(`token_ids`) and the prompt's once (`prompt_token_ids`), written into JSON already framed."""

from __future__ import annotations

from collections.abc import Sequence


def ids_json(ids: Sequence[int]) -> str:
    return f"[{','.join(map(str, ids))}]"


def with_fields(obj_json: str, **fields: Sequence[int] | None) -> str:
    """A JSON object's text with `fields` (lists of ints; None: left out) added at its end."""
    extra = "".join(f',"{k}":{ids_json(v)}' for k, v in fields.items() if v is not None)
    return obj_json[:-1] + extra + "}" if extra else obj_json


def event_with(event: str, **fields: Sequence[int] | None) -> str:
    """An SSE `data:` event (service/server/chunk_json.py) with `fields` added to its object."""
    body = event.rstrip("\n")
    return with_fields(body, **fields) + "\n\n"
