"""OpenAI/vLLM request bodies (pydantic) and request -> SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sampling_params import MAX_TOKEN_ID, SEED_MAX, SEED_MIN, SamplingParams
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.unsupported_fields import (SAMPLING_UNSUPPORTED, Harmless, asks_nothing,
                                                refuse_unsupported)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions

# Integers that reach torch tensors or Python's C APIs: a token id is an int32, anything else
# (seed, priority, counts) a signed int64. Larger values would overflow there, not here.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
# vLLM's cache_salt: a tenant's secret mixed into its first block hash. Long enough for any key
# or digest; capped so a salt cannot be a way to send megabytes the engine hashes.
MAX_CACHE_SALT_LEN = 1024
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_LEN)]
# Keyword arguments of apply_chat_template itself: as template variables they would change what
# the call does (tokenize, truncate) rather than what the template sees.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, like vLLM (clients send vendor extras). No float
    # may be NaN or infinite: they compare false with every bound and poison the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Cross-field checks and caps pydantic cannot express; InvalidRequestError (400)."""


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Fields common to completions and chat completions, named as OpenAI and vLLM name them."""

    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0
    cache_salt: CacheSalt | None = None
    # known, not supported (service/unsupported_fields.py): typed loosely so the 400 names the field
    use_beam_search: Any = None
    best_of: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    logit_bias: Any = None
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    store: Any = None
    service_tier: Any = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = SAMPLING_UNSUPPORTED

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        refuse_unsupported(self, self.UNSUPPORTED)
        if not 1 <= self.n <= limits.max_n:
            raise InvalidRequestError(f"n must be in [1, {limits.max_n}] (--max-n), got "
                                      f"{self.n}", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stop:
            raise InvalidRequestError(f"stop holds {len(stops)} strings; at most "
                                      f"{limits.max_stop} are allowed (--max-stop)", param="stop")
        if any(len(s) > limits.max_stop_len for s in stops):
            raise InvalidRequestError(f"a stop string is longer than {limits.max_stop_len} "
                                      "characters (--max-stop-length)", param="stop")
        if len(self.stop_token_ids or ()) > limits.max_stop:
            raise InvalidRequestError(f"stop_token_ids holds {len(self.stop_token_ids or ())} "
                                      f"ids; at most {limits.max_stop} are allowed (--max-stop)",
                                      param="stop_token_ids")

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


def check_logprobs(value: int | None, param: str, limits: RequestLimits) -> None:
    if value is not None and not 0 <= value <= limits.max_logprobs:
        raise InvalidRequestError(f"{param} must be in [0, {limits.max_logprobs}] "
                                  f"(--max-logprobs), got {value}", param=param)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: Any = None
    prompt_embeds: Any = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        **SAMPLING_UNSUPPORTED, "suffix": asks_nothing, "prompt_embeds": asks_nothing}

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        check_max_tokens(self.max_tokens, "max_tokens")
        check_logprobs(self.logprobs, "logprobs", limits)
        if isinstance(self.prompt, list) and (not self.prompt or any(
                isinstance(p, list) and not p for p in self.prompt)):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        count = len(self.prompts())
        if count > limits.max_prompts:
            raise InvalidRequestError(
                f"prompt holds {count} prompts; at most {limits.max_prompts} are allowed in one "
                "request (--max-prompts-per-request): send several requests", param="prompt")

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
    tool_calls: Any = None
    function_call: Any = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        "tool_calls": asks_nothing, "function_call": asks_nothing}

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

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        **SAMPLING_UNSUPPORTED,
        "tools": asks_nothing,
        # with no tools, "auto" can only mean "answer in text", which is what happens
        "tool_choice": lambda v, _: v in (None, "none", "auto"),
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
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs must not set {reserved}: they are arguments of the "
                "template call, not template variables (send chat_template as its own field)",
                param="chat_template_kwargs")

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

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
