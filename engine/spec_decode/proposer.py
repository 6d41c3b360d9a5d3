"""The proposer contract: what every speculative-decoding method (ngram, suffix, draft_model,
eagle, eagle3) implements, and the view of a request it gets.

A proposer drafts up to `num_tokens` next tokens per running request; the engine then scores
the request's last token and its drafts in one forward of the target model and keeps the longest
prefix the target agrees with (engine/spec_decode/rejection_sampler.py), plus one token of the
target's own. The drafts are deterministic proposals (q is one-hot on the draft), as in vLLM v1:
that is what makes the verification exact whatever the proposer does, so a proposer may return
anything (fewer tokens, none, bad ones) without changing the output distribution, only the speed.

Life of a proposer (one per engine, built by `registry.make_proposer`):
- `propose(requests, num_tokens)` before a step is scheduled, for the requests that are decoding
  (their prompt is computed); returns one draft list per request, in order, each at most
  `num_tokens` long (shorter or empty: nothing worth proposing). It must not keep references to
  `token_ids` beyond the call (the engine reuses the buffers).
- `on_step(step)` after each forward of the target, only when the class sets
  `uses_hidden_states = True` (EAGLE heads): the target's hidden states of the step.
- `release(request_id)` once a request is finished, aborted or preempted by recompute: drop
  whatever it keeps for it (a draft model's KV, an EAGLE head's hidden state, a suffix tree).

`SpecRequestView.request_id` identifies one token stream: the request id, with "#<i>" appended
for the i-th of n > 1 parallel samples (i > 0), so each sample has its own drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

    from kvserve.engine.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class SpecRequestView:
    """One decoding stream as a proposer sees it."""

    request_id: str  # the stream's id (see the module doc: "#<i>" for the i-th sample, i > 0)
    token_ids: np.ndarray  # int64 [num_tokens]: prompt then output, the last one not yet computed
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may need of the engine it serves: built once at start."""

    vocab_size: int
    max_model_len: int
    device: Any = None  # torch.device of the target model
    dtype: Any = None  # torch.dtype of the target model
    hf_config: Any = None  # the target's transformers config
    target_model: Any = None  # the target torch module (EAGLE shares its embedding / lm_head)
    model_path: str | None = None  # the target's resolved checkpoint folder


@dataclass(frozen=True)
class StepHiddenStates:
    """One target forward's hidden states, for proposers fed by them (EAGLE).

    Rows of `hidden_states` are the step's flattened tokens; request i owns rows
    `query_start_loc[i]:query_start_loc[i + 1]`, of which the first `num_kept[i]` hold tokens
    that stay (a prefill chunk: all; a verification: the last token and the accepted drafts).
    `token_ids[i]` are those kept tokens' ids, `positions[i]` the first one's position."""

    request_ids: list[str]
    hidden_states: "torch.Tensor"  # [T, hidden] of the target's last layer (after the final norm)
    query_start_loc: list[int]  # B + 1 offsets into the rows
    num_kept: list[int]
    token_ids: list[list[int]]
    positions: list[int]
    finished_prefill: list[bool]  # whether the request's prompt is now fully computed


class Proposer(ABC):
    """A speculative-decoding method; subclasses register under `method` (registry.py)."""

    method: ClassVar[str] = ""
    uses_hidden_states: ClassVar[bool] = False  # True: the engine calls `on_step` every step

    def __init__(self, config: "SpeculativeConfig", context: ProposerContext) -> None:
        self.config = config
        self.context = context

    @abstractmethod
    def propose(self, requests: Sequence[SpecRequestView], num_tokens: int) -> list[list[int]]:
        """Drafts per request (same order), each at most `num_tokens` ids (may be empty)."""

    def on_step(self, step: StepHiddenStates) -> None:  # noqa: B027 - optional hook
        """The target's hidden states of the step just run (only if `uses_hidden_states`)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """Forget whatever is kept for `request_id` (finished, aborted or recomputed)."""
