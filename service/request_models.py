"""OpenAI/vLLM request bodies (pydantic) and request -> SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.sample.continuation import Continuation
from kvserve.engine.sample.sampling_params import MAX_TOKEN_ID, SEED_MAX, SEED_MIN, SamplingParams
from kvserve.engine.structured_output.params import StructuredOutputsParams
from kvserve.service.beam_request import beam_sampling_params, check_beam
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.structured_outputs import constraint_of
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
class OpenAIModel(BaseModel):
    # Unknown fields are accepted and ignored, like vLLM (clients send vendor extras). No float
    # may be NaN or infinite: they compare false with every bound and poison the sampler.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        """Cross-field checks and caps pydantic cannot express; InvalidRequestError (400)."""


class ContinuationField(OpenAIModel):
    """kvserve's `continuation`: the output tokens one choice already has (a router migrating a
    request from a replica that died or drains); the request goes on after them and answers
    only what follows (docs/guides/vllm.md, "Continuations and token ids")."""

    token_ids: list[TokenId]
    index: Annotated[int, Field(ge=0, le=SEED_MAX)] = 0


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
    cache_salt: CacheSalt | None = None
    continuation: ContinuationField | None = Field(None, description=(
        "kvserve's: the output one choice already has (token ids, its index); the request goes "
        "on after it and answers only what follows. n = 1, one prompt, no echo."))
    return_token_ids: bool = Field(False, description=(
        "vLLM's: each choice (each stream chunk) carries the token ids of its text, and the "
        "prompt's once"))
    kv_transfer_params: dict[str, Any] | None = Field(None, description=(
        "vLLM's, for prefill/decode disaggregation with --kv-transfer-config: "
        "{\"do_remote_decode\": true} on the prefill request (its response's kv_transfer_params "
        "say where its blocks are); those params sent back on the decode request pull the "
        "blocks (docs/guides/disaggregation.md)"))
    # known, not supported (service/unsupported_fields.py): typed loosely so the 400 names the field
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
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
    prompt_logprobs: Int64 | None = None  # vLLM's: top logprobs of every prompt token
    # known, not supported (see _SAMPLING_UNSUPPORTED): typed loosely so the 400 names the field
    use_beam_search: Any = None
    length_penalty: Any = None
    early_stopping: Any = None
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
        check_beam(self)  # use_beam_search, length_penalty (service/beam_request.py)
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
        check_logprobs(self.prompt_logprobs, "prompt_logprobs", limits)
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs cannot be streamed (as vLLM): send the "
                                      "request with stream false", param="prompt_logprobs")
        self.constraint()  # a malformed schema, regex or tool is a 400 here
        self._check_continuation()

    def _check_continuation(self) -> None:
        if self.continuation is None:
            return
        if self.n != 1 or (self.best_of or 1) != 1:
            raise InvalidRequestError("a continuation continues one choice: send it with n = 1 "
                                      "and no best_of, the choice's number as continuation.index",
                                      param="continuation")
        if self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs cannot be combined with a continuation "
                                      "(the first request had them)", param="continuation")

    def continuation_of(self) -> Continuation | None:
        """The engine's Continuation of this request (None: an ordinary request)."""
        c = self.continuation
        return None if c is None else Continuation(tuple(c.token_ids), c.index)

    @property
    def continued_tokens(self) -> int:
        """Output tokens the continuation brings: counted in usage.completion_tokens."""
        return 0 if self.continuation is None else len(self.continuation.token_ids)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams of this request; a field it leaves out takes `defaults` (the model's
        generation config), then OpenAI's. InvalidRequestError (400) for a value out of range."""
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
             "repetition_penalty": 1.0, **{k: v for k, v in (defaults or {}).items()
                                           if k != "max_tokens"}}
        own = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                               "repetition_penalty")}
        if self.use_beam_search:
            return beam_sampling_params(self, max_tokens)
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
            prompt_logprobs=self.num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
            logit_bias=self.token_logit_bias(),
            extra_args={"kv_transfer_params": self.kv_transfer_params}
            if self.kv_transfer_params else None,
        )

    def num_prompt_logprobs(self) -> int | None:
        """How many top logprobs each prompt token gets (None: no prompt logprobs)."""
        return self.prompt_logprobs

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
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    max_tokens: Int64 | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: Any = None
    # vLLM's: base64 of torch.save'd [seq_len, hidden] tensors (--enable-prompt-embeds)
    prompt_embeds: str | list[str] | None = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        **SAMPLING_UNSUPPORTED, "suffix": asks_nothing}

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        if not (self.echo and self.max_tokens == 0):  # echo alone scores the prompt (OpenAI's)
            check_max_tokens(self.max_tokens, "max_tokens")
        check_logprobs(self.logprobs, "logprobs", limits)
        if self.prompt in (None, "") and not self.embeds_prompts():  # vLLM's rule and words
            raise InvalidRequestError(
                "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if isinstance(self.prompt, list) and (not self.prompt or any(
                isinstance(p, list) and not p for p in self.prompt)):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        count = len(self.prompts()) + len(self.embeds_prompts())
        if self.continuation is not None and (count != 1 or self.echo):
            raise InvalidRequestError("a continuation continues one prompt's choice: send one "
                                      "prompt and no echo", param="continuation")
        if count > limits.max_prompts:
            raise InvalidRequestError(
                f"prompt holds {count} prompts; at most {limits.max_prompts} are allowed in one "
                "request (--max-prompts-per-request): send several requests", param="prompt")

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs covers the prompt tokens too: their logprobs are prompt logprobs
        (vLLM's rule: prompt_logprobs, else logprobs when echo is set)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the answer is the prompt alone (one token is generated and
        dropped, as vLLM does)."""
        return self.echo and self.max_tokens == 0

    def embeds_prompts(self) -> list[str]:
        """The prompt_embeds field as a list of base64 tensors (served before the prompts)."""
        e = self.prompt_embeds
        return [] if e is None else [e] if isinstance(e, str) else list(e)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts: text or token ids (none when it is empty
        beside prompt_embeds, as vLLM)."""
        p = self.prompt
        if p is None or p == "":
            return []
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
