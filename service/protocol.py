"""OpenAI/vLLM request and response models (pydantic), and request -> SamplingParams."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, like vLLM (clients send vendor extras).
    model_config = ConfigDict(extra="ignore")

    def check(self) -> None:
        """Cross-field checks pydantic cannot express; InvalidRequestError (400) on failure."""


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields common to completions and chat completions, named as OpenAI and vLLM name them."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams of this request; InvalidRequestError (400) for a value out of range."""
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {value}.", param=param)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check(self) -> None:
        check_max_tokens(self.max_tokens, "max_tokens")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if isinstance(self.prompt, list) and (not self.prompt or any(
                isinstance(p, list) and not p for p in self.prompt)):
            raise InvalidRequestError("prompt must not be empty", param="prompt")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """{"role", "content"} with content parts flattened to text (text-only models)."""
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
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None

    def check(self) -> None:
        check_max_tokens(self.max_tokens, "max_tokens")
        check_max_tokens(self.max_completion_tokens, "max_completion_tokens")
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
