"""The /tokenize and /detokenize request bodies (pydantic)."""

from __future__ import annotations

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.chat_request import ChatMessage
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_models import OpenAIModel, TokenId
from kvserve.service.tool_calls import check_history


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        check_history(self.messages or [])  # the template renders tool calls: each needs a name


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
