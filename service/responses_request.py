"""The /v1/responses request body (OpenAI's Responses API) and its translation into the chat
completions request the server already runs: input items -> messages, function tools -> tools,
`text.format` -> response_format, `max_output_tokens` -> max_tokens."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_models import Int64, OpenAIModel
from kvserve.service.unsupported_fields import Harmless, asks_nothing, refuse_unsupported

# Request fields passed through to the chat request as they are (vLLM's extras included).
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "priority",
           "cache_salt", "repetition_penalty", "presence_penalty", "frequency_penalty",
           "continuation", "return_token_ids")


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    priority: Int64 = 0
    cache_salt: str | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    # kvserve's continuation and vLLM's return_token_ids: checked by the chat request
    continuation: Any = None
    return_token_ids: bool | None = None
    # known, not supported: a 400 naming the field unless its value asks for nothing
    previous_response_id: Any = None
    store: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    conversation: Any = None
    prompt: Any = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        "previous_response_id": asks_nothing,  # responses are not stored: send the history
        "store": asks_nothing,
        "background": asks_nothing,
        "reasoning": lambda v, _: v is None or not (v or {}).get("effort"),
        "include": asks_nothing,
        "conversation": asks_nothing,
        "prompt": asks_nothing,
        "truncation": lambda v, _: v in (None, "disabled"),
    }

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        refuse_unsupported(self, self.UNSUPPORTED)
        self.as_chat(limits)  # every translation error is a 400 here

    def as_chat(self, limits: RequestLimits = DEFAULT_LIMITS) -> ChatCompletionRequest:
        """The same request as /v1/chat/completions takes it (checked against `limits`)."""
        body = self.chat_body()
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise InvalidRequestError(f"{where}: {err['msg']}", where) from None
        chat.check(limits)
        return chat

    def chat_body(self) -> dict[str, Any]:
        """The chat completions request body of this request, unchecked (the router sends it
        to a replica's /v1/chat/completions when it migrates a Responses request)."""
        body: dict[str, Any] = {k: _plain(getattr(self, k)) for k in _PASSED
                                if getattr(self, k) is not None}
        body["messages"] = _messages(self.instructions, self.input)
        if self.tools:
            body["tools"] = [_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        fmt = _response_format((self.text or {}).get("format"))
        if fmt is not None:
            body["response_format"] = fmt
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def _plain(value: Any) -> Any:
    """A field's value as JSON would carry it (a nested model as its dict)."""
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


def _messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict]:
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"input[{i}].role must be user, assistant, system or "
                                          f"developer, got {role!r}", f"input.{i}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), i)})
        else:
            raise InvalidRequestError(f"input[{i}] has type {kind!r}; this server takes "
                                      "message, function_call and function_call_output items",
                                      f"input.{i}.type")
    return messages


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in (
            "input_text", "output_text", "text") for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidRequestError(f"input[{i}].content must be text or input_text parts (this model "
                              "reads text only)", f"input.{i}.content")


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise InvalidRequestError(f"tools[{i}] must be a function tool {{\"type\": \"function\", "
                                  f"\"name\": ...}}; got type {tool.get('type')!r}", f"tools.{i}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    return fmt  # json_object, or a bad one the chat request names
