"""Stream chunks framed as SSE events without a pydantic round trip: the bytes the response models
(service/response_models.py) write for the same chunk, field for field and in their order.

Streaming sends one chunk per token per stream; building `ChatCompletionChunk` /
`CompletionResponse` and dumping it cost more than the rest of the chunk's path. Each stream's
constant part (id, object, created, model) is written once; a chunk adds its choice and usage.
Nested objects that carry floats (logprobs) are still dumped by their pydantic model, which
writes -inf as null, as the whole chunk's dump did (tests/unit/service/test_chunk_json.py)."""

from __future__ import annotations

import json

from pydantic import BaseModel

# JSON strings as pydantic writes them: UTF-8 left as is, control characters escaped.
_string = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _value(v: str | int | None) -> str:
    """A string, an int (stop_reason may be a token id) or null."""
    if v is None:
        return "null"
    return _string(v) if isinstance(v, str) else str(int(v))


def _model(m: BaseModel | None) -> str:
    return "null" if m is None else m.model_dump_json()


def usage_json(prompt: int, completion: int, cached: int | None) -> str:
    """UsageInfo's JSON; `cached` None leaves prompt_tokens_details null."""
    details = "null" if cached is None else f'{{"cached_tokens":{cached}}}'
    return (f'{{"prompt_tokens":{prompt},"completion_tokens":{completion},'
            f'"total_tokens":{prompt + completion},"prompt_tokens_details":{details}}}')


class ChunkFramer:
    """The SSE events of one stream: `object` is "chat.completion.chunk" or "text_completion"."""

    def __init__(self, obj: str, request_id: str, model: str, created: int) -> None:
        self._head = (f'data: {{"id":{_string(request_id)},"object":"{obj}",'
                      f'"created":{created},"model":{_string(model)},"choices":[')

    def event(self, choices: list[str], usage: str = "null") -> str:
        """One `data:` event of `choices` (each already JSON) and `usage` (JSON)."""
        return f'{self._head}{",".join(choices)}],"usage":{usage}}}\n\n'


def chat_choice(index: int, content: str | None, *, role: str | None = None,
                logprobs: BaseModel | None = None, finish_reason: str | None = None,
                stop_reason: int | str | None = None) -> str:
    """A ChatStreamChoice whose delta holds a role and/or content (no reasoning, no tool
    calls: those chunks still go through the models)."""
    return (f'{{"index":{index},"delta":{{"role":{_value(role)},"content":{_value(content)},'
            f'"tool_calls":null}},"logprobs":{_model(logprobs)},'
            f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)}}}')


def completion_choice(index: int, text: str, *, logprobs: BaseModel | None = None,
                      finish_reason: str | None = None,
                      stop_reason: int | str | None = None) -> str:
    """A streamed CompletionChoice (its prompt_logprobs is never set in a stream)."""
    return (f'{{"index":{index},"text":{_string(text)},"logprobs":{_model(logprobs)},'
            f'"finish_reason":{_value(finish_reason)},"stop_reason":{_value(stop_reason)},'
            f'"prompt_logprobs":null}}')

