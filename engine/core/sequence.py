"""Sequence: one token stream the scheduler runs (a request, or one of its n parallel samples)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.core.block_hash import extra_keys_for
from kvserve.engine.sample.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """All state of one stream: tokens, progress, and where it sits in the scheduler.

    `num_computed_tokens` counts tokens whose K/V are in the cache; tokens beyond it are scheduled
    next. The KV cache manager keeps the block table, keyed by `seq_id`.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with (None: the base model)
    # [P, hidden] CPU tensor fed for the prompt positions in place of embedded token ids
    # (engine/prompt_embeds.py); prompt_token_ids are then P placeholders (0), never hashed.
    prompt_embeds: Any = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache (-1 = not looked up)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs=k: [None, then one {token_id: Logprob} per prompt position recorded so far]
    prompt_logprobs: list | None = None
    # The n > 1 parent samples n tokens after its prefill and forks its siblings then.
    pending_forks: int = 0
    # A beam search's seqs share one group (engine/core/beam_group.py): admitted and preempted
    # together, and their tokens chosen together.
    group: Any = None
    # Speculative decoding (engine/spec_decode/): tokens drafted for the next step, scored
    # after the seq's last token when the scheduler has room for them.
    spec_token_ids: list[int] = field(default_factory=list)
    # What a KV connector says of the finished request (vLLM's kv_transfer_params of its output:
    # where a prefill replica holds its blocks), engine/kv_transfer/.
    kv_transfer_params: dict | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Asks prompt logprobs and has not all of them yet: its prefill must compute every
        prompt position (no prefix-cache hits, engine/sample/prompt_logprobs.py)."""
        return self.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs or [None]) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def extra_keys(self) -> object:
        return extra_keys_for(self.cache_salt, self.lora_name)
