"""The engine core's view of one request: its sequences (one per sample), their text trackers,
grammar matchers and a continuation's bookkeeping (vLLM v1's `Request`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvserve.engine.core.sequence import Sequence
from kvserve.engine.outputs import RequestMetrics
from kvserve.engine.sample.continuation import Continuation
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.structured_output.grammar import GrammarState


class TextTracker(Protocol):
    """A sample's incremental text (engine/sample/detokenizer.py): `update` returns the stop
    string the new tokens completed, if any; `flush` ends the text at a finish."""

    text: str

    def update(self, output_token_ids: list[int]) -> str | None: ...

    def flush(self, output_token_ids: list[int]) -> None: ...


@dataclass
class NewRequest:
    """A request the processor checked (engine/processor.py), ready for `EngineCore.add_request`
    (vLLM's EngineCoreRequest)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # as the core runs it: best_of expanded, max_tokens capped
    arrival_time: float
    new_text: Callable[[], TextTracker]  # a fresh text tracker per sample (forks included)
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None
    lora_request: Any = None
    grammar: Any = None  # the compiled constraint of a structured-output request
    best_of: Any = None  # sample/best_of.BestOf: show only the best n of params.n candidates
    makes_text: bool = True  # False: the engine core's client detokenises (engine_core/)
    prompt_embeds: Any = None  # [P, hidden] in place of the prompt's P (placeholder) token ids
    continuation: Continuation | None = None  # output already generated elsewhere


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[TextTracker]
    metrics: RequestMetrics
    grammar: Any = None  # the compiled constraint of a structured-output request
    matchers: dict[int, GrammarState] = field(default_factory=dict)  # sample index -> matcher
    best_of: Any = None  # show only the best n of params.n candidates
    makes_text: bool = True  # False: the engine core's client detokenises (engine_core/)
    lora_request: Any = None  # the LoRARequest it runs with, shown on its outputs
    new_text: Callable[[], TextTracker] | None = None  # a fork's text tracker
    prompt_embeds: Any = None  # the prompt came as embeddings: outputs show no token ids
    # A continuation's choice: the first sample's index (outputs, seeded draws), and its output
    # tokens and text, which the outputs leave out (the client has them already)
    first_index: int = 0
    skip_tokens: int = 0
    skip_chars: int = 0

    beam: Any = None  # a beam search's group (engine/core/beam_group.py): its seqs are the beams

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return bool(self.beam.done)
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)
