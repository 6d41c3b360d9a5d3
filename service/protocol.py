"""OpenAI/vLLM request and response models (pydantic), and request -> SamplingParams."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.guided_params import StructuredOutputsParams
from kvserve.engine.sampling_params import MAX_TOKEN_ID, SEED_MAX, SEED_MIN, SamplingParams
from kvserve.service.structured_outputs import constraint_of
from kvserve.service.tool_calls import ToolPlan, check_history, tool_plan

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request, checked at the edge (server and router); each is a CLI flag."""

    max_json_depth: int = 32  # --max-json-depth: nesting of arrays/objects in the body
    max_prompts: int = 64  # --max-prompts-per-request: prompts in one /v1/completions body
    max_prompt_tokens: int = 131072  # --max-prompt-tokens-per-request: all prompts together
    max_n: int = 16  # --max-n
    max_stop: int = 16  # --max-stop: entries of `stop`, and of `stop_token_ids`
    max_stop_len: int = 256  # --max-stop-length: characters of one stop string
    max_logprobs: int = 20  # --max-logprobs: `logprobs` / `top_logprobs` (20 is OpenAI's cap)


DEFAULT_LIMITS = RequestLimits()

# Integers that reach torch tensors or Python's C APIs: a token id is an int32, anything else
# (seed, priority, counts) a signed int64. Larger values would overflow there, not here.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- the JSON body


def parse_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    """The body as a JSON object; InvalidRequestError for invalid JSON or UTF-8, an integer past
    Python's parsing limit, nesting deeper than `max_depth`, an unpaired surrogate, a non-object.

    The C parser raises RecursionError on very deep input (caught here); anything shallower than
    that is measured by an iterative walk, so no later recursive code sees a deep tree."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise InvalidRequestError("the request body holds an unpaired UTF-16 surrogate "
                                          "(\\ud800-\\udfff); send valid Unicode text")
            continue
        if depth > max_depth:
            raise _too_deep(max_depth)
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)) or (
            isinstance(c, str) and not c.isascii()))
    return data


def _too_deep(max_depth: int) -> InvalidRequestError:
    return InvalidRequestError(f"the request body is nested deeper than {max_depth} levels of "
                               "arrays and objects (--max-json-depth)")


def _asks_nothing(value: Any, _: Any = None) -> bool:
    """A value that turns a feature off: absent, null, false, an empty list, object or string."""
    return value is None or value is False or (isinstance(value, (list, dict, str)) and not value)


def refuse_unsupported(req: BaseModel, table: dict[str, Callable[[Any, Any], bool]],
                       prefix: str = "") -> None:
    """400 naming the first known-but-unsupported field set to a value that asks for something."""
    for name, harmless in table.items():
        value = getattr(req, name)
        if not harmless(value, req):
            raise InvalidRequestError(
                f"{prefix}{name} is not supported by this server (got {json.dumps(value)[:80]}); "
                "remove it from the request", param=f"{prefix}{name}")


class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, like vLLM (clients send vendor extras). No float
    # may be NaN or infinite: they compare false with every bound and poison the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Cross-field checks and caps pydantic cannot express; InvalidRequestError (400)."""


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


# Known to OpenAI or vLLM, not implemented here: each is refused with a 400 naming it, unless its
# value asks for nothing (the predicate). Fields nobody knows are still ignored.
_SAMPLING_UNSUPPORTED: dict[str, Callable[[Any, Any], bool]] = {
    "use_beam_search": _asks_nothing,
    "length_penalty": lambda v, _: v is None or v == 1.0,
    "early_stopping": _asks_nothing,
    "prompt_logprobs": lambda v, _: v is None,  # 0 asks for the prompt tokens' own logprobs
    "allowed_token_ids": _asks_nothing,
    "bad_words": _asks_nothing,
    "truncate_prompt_tokens": lambda v, _: v is None,
    "logits_processors": _asks_nothing,
    "return_tokens_as_token_ids": _asks_nothing,
    "store": _asks_nothing,
    "service_tier": lambda v, _: v in (None, "auto", "default"),
}


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
    repetition_penalty: float | None = None
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
    cache_salt: str | None = None
    # structured outputs (service/structured_outputs.py): typed loosely, checked there
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's) -> bias
    best_of: Int64 | None = None  # sample this many, answer with the n most likely
    # known, not supported (see _SAMPLING_UNSUPPORTED): typed loosely so the 400 names the field
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    store: Any = None
    service_tier: Any = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any, Any], bool]]] = _SAMPLING_UNSUPPORTED

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        refuse_unsupported(self, self.UNSUPPORTED)
        if not 1 <= self.n <= limits.max_n:
            raise InvalidRequestError(f"n must be in [1, {limits.max_n}] (--max-n), got "
                                      f"{self.n}", param="n")
        if self.best_of is not None and not self.n <= self.best_of <= limits.max_n:
            raise InvalidRequestError(f"best_of must be in [n, {limits.max_n}] (--max-n), got "
                                      f"{self.best_of}", param="best_of")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError("best_of > n cannot be streamed: the best candidates are "
                                      "known only at the end", param="best_of")
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
        self.constraint()  # a malformed schema, regex or tool is a 400 here

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of this request; a field it leaves out takes `defaults` (the model's
        generation config), then OpenAI's. InvalidRequestError (400) for a value out of range."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
             "repetition_penalty": 1.0, **{k: v for k, v in (defaults or {}).items()
                                           if k != "max_tokens"}}
        own = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                               "repetition_penalty")}
        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            **{k: d[k] if v is None else v for k, v in own.items()},
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
            logit_bias=self.token_logit_bias(),
        )

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with int keys; 400 for a key that is not a token id."""
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                      param="logit_bias") from None

    def constraint(self) -> StructuredOutputsParams | None:
        """What the output must match (response_format, guided_*, structured_outputs)."""
        return constraint_of(self)

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

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any, Any], bool]]] = {
        **_SAMPLING_UNSUPPORTED, "suffix": _asks_nothing, "prompt_embeds": _asks_nothing}

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


def check_prompt_tokens(counts: list[int], limits: RequestLimits, param: str = "prompt") -> None:
    """400 when the prompts of one request hold more tokens in all than the cap."""
    total = sum(counts)
    if total > limits.max_prompt_tokens:
        raise InvalidRequestError(
            f"the prompts of this request hold {total} tokens; at most "
            f"{limits.max_prompt_tokens} are allowed in one request "
            "(--max-prompt-tokens-per-request)", param=param)


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call
    function_call: Any = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any, Any], bool]]] = {
        "function_call": _asks_nothing}

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

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any, Any], bool]]] = {
        **_SAMPLING_UNSUPPORTED,
        "functions": _asks_nothing,
        "function_call": lambda v, _: v in (None, "none", "auto"),
        "echo": _asks_nothing,
        "continue_final_message": _asks_nothing,
        "audio": _asks_nothing,
        "modalities": lambda v, _: v is None or v == ["text"],
        "prediction": _asks_nothing,
        "reasoning_effort": _asks_nothing,
        "web_search_options": _asks_nothing,
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

    def tool_plan(self) -> ToolPlan | None:
        return tool_plan(self.tools, self.tool_choice)

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
    tool_calls: list[dict[str, Any]] | None = None


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
    tool_calls: list[dict[str, Any]] | None = None


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
