"""What travels between the engine core process and its client: plain dataclasses, pickled.

Requests carry the engine's own objects (`SamplingParams`, and any keyword `add_request` takes,
e.g. a `lora_request`) as they are, so a new request field needs no change here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any



# ---- client -> core ------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: Any  # SamplingParams
    kwargs: dict[str, Any] = field(default_factory=dict)  # add_request's keywords, passed through


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class UtilityCall:
    """`getattr(engine, method)(*args, **kwargs)` in the core; the answer is a UtilityResult."""

    call_id: int
    method: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Shutdown:
    """Abort what runs, stop the engine (and its tensor-parallel workers), exit."""


# ---- core -> client ------------------------------------------------------------------------
@dataclass
class CoreReady:
    """The engine is built: what the client needs to know of it, fixed for its life."""

    model_name: str
    max_model_len: int
    block_size: int
    memory_budget: Any
    sampling_defaults: dict[str, Any]
    config: Any  # EngineConfig
    tokenizer: Any
    eos_token_ids: Any
    model_weight_bytes: int


# One request's progress in one step travels as a plain tuple (pickled in C: 7x faster than
# dataclasses at 256 streams, bench/core_transport.py):
#   RequestDelta = (request_id, finished, num_cached_tokens, metrics, outputs, full,
#                   prompt_token_ids, prompt_logprobs, kv_transfer_params)
# metrics: RequestMetrics' fields as a tuple; outputs: a list of CompletionDelta, or None when
# `full` (the whole CompletionOutputs) replaces them: requests whose text the core makes itself
# (best_of, n > 1 with stop strings); prompt_token_ids / prompt_logprobs: the first delta only.
#   CompletionDelta = (index, new token_ids, new logprob entries | None, cumulative_logprob,
#                      finish_reason, stop_reason)
RequestDelta = tuple
CompletionDelta = tuple


@dataclass
class StepMessage:
    """Everything one step of the core produced (sent also when idle, every `idle_tick`)."""

    accepted: list[tuple[str, BaseException | None]]  # adds since the last step: None = ok
    deltas: list[RequestDelta]  # tuples, see above
    errors: dict[str, BaseException]  # requests that failed alone (already aborted)
    stats: Any  # EngineStats
    events: list[Any]  # KVEvents (device and host tiers)
    alloc_seconds: list[float]
    restore_seconds: list[float]
    sent_at: float  # time.monotonic() in the core (one clock for both processes)


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: BaseException | None = None
    steps_sent: int = 0  # StepMessages the core sent before this reply (another socket)


@dataclass
class CoreDead:
    """The core failed (a startup error, a kernel fault, a lost worker) and exits."""

    reason: str
    during_startup: bool = False


@dataclass
class CoreStopped:
    """Answer to Shutdown: the engine is stopped; nothing follows."""
