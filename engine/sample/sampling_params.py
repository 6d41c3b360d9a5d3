"""SamplingParams: per-request decoding settings, with vLLM's field names and checks."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# A seed is a signed 64-bit integer, as in vLLM (torch.iinfo(torch.long)); `seed + sample index`
# then stays inside what torch.Generator.manual_seed takes ([-2**63, 2**64 - 1]).
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# Upper bounds that keep every value finite in the sampler's float32 and int64 tensors.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOKEN_ID = (1 << 31) - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")
_INTS = ("n", "best_of", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "seed")


class RequestOutputKind(Enum):
    """What each streamed output holds (vLLM's; AsyncLLM.generate): everything so far, only what
    is new since the last one, or nothing until the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # sample this many, return the n most likely (sample/best_of.py)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # top logprobs per prompt token (sample/prompt_logprobs.py)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's)
    # What the output must match (structured_output/params.py): vLLM's current and older spellings.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # AsyncLLM.generate's streams
    extra_args: dict | None = None  # read by custom logits processors (vLLM's)
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == 0:
            self.top_k = -1
        self.verify()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint, under whichever name it was given."""
        return self.structured_outputs if self.structured_outputs is not None \
            else self.guided_decoding

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def verify(self) -> None:
        """InvalidRequestError naming the first field out of range. Also called by the engine
        when a request is added, since a SamplingParams can be changed after it was built."""
        def bad(param: str, msg: str) -> None:
            raise InvalidRequestError(f"{param} {msg}", param=param)

        self._verify_types(bad)
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            bad("seed", f"must be a signed 64-bit integer (in [{SEED_MIN}, {SEED_MAX}]), "
                f"got {self.seed}.")
        if self.n < 1:
            bad("n", f"must be at least 1, got {self.n}.")
        if self.best_of is not None and self.best_of < self.n:
            bad("best_of", f"must be at least n ({self.n}), got {self.best_of}.")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            bad("top_k", f"must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}.")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}], got "
                f"{self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", f"must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}.")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", f"must be in [0, 20], got {self.prompt_logprobs}.")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            bad("stop", "must be a string or a list of non-empty strings.")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t <= MAX_TOKEN_ID
               for t in self.stop_token_ids or []):
            bad("stop_token_ids", f"must be token ids in [0, {MAX_TOKEN_ID}].")
        self._verify_constraint(bad)
        self._verify_logit_bias(bad)

    def _verify_logit_bias(self, bad: Callable[[str, str], None]) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", "must map token ids to biases.")
        for tok, value in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) \
                    or not 0 <= tok <= MAX_TOKEN_ID:
                bad("logit_bias", f"keys must be token ids, got {tok!r}.")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                bad("logit_bias", f"values must be in [-100, 100], got {value!r} for token {tok}.")

    def _verify_constraint(self, bad: Callable[[str, str], None]) -> None:
        given = [c for c in (self.structured_outputs, self.guided_decoding) if c is not None]
        if any(not isinstance(c, StructuredOutputsParams) for c in given):
            bad("structured_outputs", "must be a StructuredOutputsParams (GuidedDecodingParams).")
        if len(given) == 2 and given[0] != given[1]:
            bad("structured_outputs", "and guided_decoding are two names for one setting; "
                "give one of them.")
        if given:
            given[0].verify()

    def _verify_types(self, bad: Callable[[str, str], None]) -> None:
        """Finite numbers of the right kind: NaN compares false with every bound, so it would
        slip through the range checks below."""
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value):
                bad(name, f"must be a finite number, got {value!r}.")
        for name in _INTS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                bad(name, f"must be an integer, got {value!r}.")
