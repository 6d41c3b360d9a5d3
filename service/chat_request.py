"""The chat completions request body (pydantic): messages, tools, the request's own template
options, and request -> SamplingParams (the shared sampling fields are in request_models.py)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import PrivateAttr

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_models import (Int64, OpenAIModel, SamplingFields, check_logprobs,
                                            check_max_tokens)
from kvserve.service.structured_outputs import constraint_of
from kvserve.service.tool_calls import ToolPlan, check_history, tool_plan
from kvserve.service.tool_parsers import DEFAULT_TOOL_PARSER
from kvserve.service.unsupported_fields import (SAMPLING_UNSUPPORTED, Harmless, asks_nothing,
                                                refuse_unsupported)

# Keyword arguments of apply_chat_template itself: as template variables they would change what
# the call does (tokenize, truncate) rather than what the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})



class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    function_call: Any = None
    # An assistant's earlier reasoning, as vLLM and OpenAI clients send it back (`reasoning:
    # null` included): accepted, and left out of the prompt as chat templates do.
    reasoning: str | None = None
    reasoning_content: str | None = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {"function_call": asks_nothing}

    def as_template_input(self) -> dict[str, Any]:
        """{"role", "content"} with content parts flattened to text (text-only models), plus
        tool_calls / tool_call_id when set (service/tool_calls.py renders them)."""
        content = self.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequestError(
                        f"content part type {part.get('type')!r} is not supported: this model "
                        "reads text only", param="messages")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    echo: Any = None
    continue_final_message: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    # the server's --tool-call-parser, set by the handler (not a request field)
    _tool_parser: str = PrivateAttr(default=DEFAULT_TOOL_PARSER)

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        **SAMPLING_UNSUPPORTED,
        "functions": asks_nothing,
        "function_call": lambda v, _: v in (None, "none", "auto"),
        "echo": asks_nothing,
        "continue_final_message": asks_nothing,
        "audio": asks_nothing,
        "modalities": lambda v, _: v is None or v == ["text"],
        "prediction": asks_nothing,
        "reasoning_effort": asks_nothing,
        "web_search_options": asks_nothing,
    }

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        check_max_tokens(self.max_tokens, "max_tokens")
        check_max_tokens(self.max_completion_tokens, "max_completion_tokens")
        check_logprobs(self.top_logprobs, "top_logprobs", limits)
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        for i, message in enumerate(self.messages):
            refuse_unsupported(message, message.UNSUPPORTED, prefix=f"messages.{i}.")
        check_history(self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs must not set {reserved}: they are arguments of the "
                "template call, not template variables (send chat_template as its own field)",
                param="chat_template_kwargs")

    def use_tool_parser(self, parser: str) -> "ChatCompletionRequest":
        self._tool_parser = parser
        return self

    def tool_plan(self) -> ToolPlan | None:
        return tool_plan(self.tools, self.tool_choice, self._tool_parser)

    def constraint(self) -> StructuredOutputsParams | None:
        """The tools' grammar (tool_choice required or named) or the response format's."""
        own = constraint_of(self)
        plan = self.tool_plan()
        forced = plan.constraint() if plan is not None else None
        if forced is not None and own is not None:
            raise InvalidRequestError("a required or named tool_choice already fixes the output's "
                                      "form; drop response_format / guided_*", "tool_choice")
        return forced or own

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
