"""RequestOutput / CompletionOutput: what `LLM.generate` and the engine's step return (vLLM names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's entry in a (prompt or sample) logprobs dict (vLLM's `vllm.logprobs.Logprob`):
    `out.outputs[0].logprobs[i][token_id].logprob`."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token at that position
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: Logprob} for the sampled token and the top-k.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: the prompt came as embeddings (as vLLM)
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # prompt_logprobs=k: None for the first prompt token, then per token {token_id: Logprob} for
    # the actual token and the k most likely (engine/sample/prompt_logprobs.py).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
    lora_request: Any = None  # the LoRARequest it ran with (None: the base model)
    num_prompt_embeds: int = 0  # rows of a prompt given as embeddings (prompt_token_ids None)
    # vLLM's: what a KV connector says of the finished request (a prefill replica: where the
    # decode replica pulls its blocks), engine/kv_transfer/
    kv_transfer_params: dict | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Positions the prompt filled: its token ids, or its embeddings' rows."""
        ids = self.prompt_token_ids
        return len(ids) if ids is not None else self.num_prompt_embeds
