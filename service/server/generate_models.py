"""The bodies of POST /inference/v1/generate, shaped as vLLM's `GenerateRequest`,
`GenerateResponse` and `GenerateStreamResponse` (vllm/entrypoints/serve/disagg/protocol.py)."""

from __future__ import annotations

import uuid
from typing import Any, ClassVar

from pydantic import BaseModel, Field

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.limits import DEFAULT_LIMITS, RequestLimits
from kvserve.service.request_models import (CacheSalt, Int64, OpenAIModel, SamplingFields,
                                            StreamOptions, TokenId, check_logprobs,
                                            check_max_tokens)
from kvserve.service.response_models import ChatLogProbs, PromptLogprobs, UsageInfo
from kvserve.service.unsupported_fields import (GENERATE_UNSUPPORTED, Harmless, asks_nothing,
                                                refuse_unsupported)


class GenerateSamplingParams(SamplingFields):
    """vLLM's `SamplingParams` as JSON. Left out, a field takes the dataclass default (not the
    model's generation config: vLLM's endpoint applies none), and max_tokens what fits."""

    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None  # top logprobs per generated token
    # The endpoint returns no text: how text would be decoded changes nothing here.
    detokenize: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: Any = None  # the server sets it (whole or streamed), as vLLM's does

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        super().check(limits)
        check_max_tokens(self.max_tokens, "sampling_params.max_tokens")
        check_logprobs(self.logprobs, "sampling_params.logprobs", limits)


class GenerateRequest(OpenAIModel):
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, max_length=256)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: GenerateSamplingParams  # required, as in vLLM
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    priority: Int64 = 0
    # vLLM's, for features this server does not have: refused by name unless empty
    features: Any = None  # multimodal inputs
    kv_transfer_params: Any = None  # disaggregated prefill
    assistant_tokens_mask: Any = None
    token_offsets: Any = None

    UNSUPPORTED: ClassVar[dict[str, Harmless]] = {
        "features": asks_nothing, "kv_transfer_params": asks_nothing}

    def check(self, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        refuse_unsupported(self, self.UNSUPPORTED)
        refuse_unsupported(self.sampling_params, GENERATE_UNSUPPORTED, "sampling_params.")
        self.sampling_params.check(limits)
        if self.stream and self.sampling_params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs cannot be streamed (as vLLM): send the "
                                      "request with stream false",
                                      param="sampling_params.prompt_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class GenerateResponseChoice(BaseModel):
    index: int
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    token_ids: list[int] | None = None
    routed_experts: str | None = None  # MoE routing (vLLM's --enable-return-routed-experts)


class GenerateResponse(BaseModel):
    request_id: str
    choices: list[GenerateResponseChoice]
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class GenerateResponseStreamChoice(BaseModel):
    index: int
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    routed_experts: str | None = None


class GenerateStreamResponse(BaseModel):
    request_id: str
    choices: list[GenerateResponseStreamChoice]
    usage: UsageInfo | None = None
