"""The /tokenize and /detokenize request bodies (pydantic), field for field vLLM's
(vllm/entrypoints/serve/tokenize/protocol.py): a prompt, or messages through the chat template."""

from __future__ import annotations

from typing import Any

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.chat_request import RESERVED_TEMPLATE_KWARGS, ChatMessage
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_models import OpenAIModel, TokenId
from kvserve.service.tool_calls import check_history
from kvserve.service.unsupported_fields import asks_nothing, refuse_unsupported


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only: a chat's special tokens are the template's
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    continue_final_message: Any = None  # known to vLLM; refused by name (as chat completions)

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        refuse_unsupported(self, {"continue_final_message": asks_nothing})
        check_history(self.messages or [])  # the template renders tool calls: each needs a name
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs must not set {reserved}",
                                      param="chat_template_kwargs")


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
