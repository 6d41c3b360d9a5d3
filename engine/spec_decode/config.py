"""SpeculativeConfig: vLLM's `speculative_config` (a dict, JSON text or this dataclass), checked
on creation; unknown fields, unknown methods and combinations that cannot run are refused by
name."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvserve.engine.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # need `model`: a draft or a head checkpoint
# draft on the host from the token ids alone: they run with async scheduling (async_scheduling.py)
HOST_METHODS = ("ngram", "suffix")
NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
SUFFIX_FIELDS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                 "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
SUFFIX_DEFAULTS = {"suffix_decoding_max_tree_depth": 24,
                   "suffix_decoding_max_cached_requests": 10000,
                   "suffix_decoding_max_spec_factor": 1.0,
                   "suffix_decoding_min_token_prob": 0.1}
# vLLM fields accepted for compatibility that change nothing here
NO_EFFECT = ("disable_log_stats", "disable_padded_drafter_batch", "quantization", "revision",
             "code_revision", "max_model_len", "enforce_eager")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # None: "draft_model" when `model` is given (as vLLM)
    num_speculative_tokens: int | None = None  # drafts per step at most (suffix: its depth)
    model: str | None = None  # the draft model or the EAGLE head (draft_model / eagle / eagle3)
    draft_tensor_parallel_size: int | None = None  # the draft's TP (1 or the target's)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (default: the max)
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched (default: 5)
    # speculation is off for a step that runs more than this many requests (None: never off)
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    # kvserve: shrink/grow the drafts per request by their measured acceptance (adaptive.py)
    adaptive: bool = True

    def __post_init__(self) -> None:
        method = self.method
        if method is None:
            if self.model is None:
                raise ConfigError("speculative_config needs a method (one of "
                                  f"{METHODS}) or a draft `model`")
            method = "draft_model"
        if method == "[ngram]":  # vLLM's older spelling of prompt lookup
            method = "ngram"
        if method not in METHODS:
            raise ConfigError(f"speculative_config: unknown method {method!r}; one of {METHODS}")
        object.__setattr__(self, "method", method)
        self._check_model(method)
        self._check_counts(method)
        self._check_ngram(method)
        self._check_suffix(method)
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ConfigError("speculative_config: disable_by_batch_size must be >= 2 (the "
                              f"batch size above which speculation is off), got "
                              f"{self.disable_by_batch_size}")

    def _check_model(self, method: str) -> None:
        if method in MODEL_METHODS and not self.model:
            raise ConfigError(f"speculative method {method!r} needs `model` (the draft model or "
                              "EAGLE head checkpoint)")
        if method not in MODEL_METHODS and self.model is not None:
            raise ConfigError(f"speculative method {method!r} takes no `model` (it drafts from "
                              f"the request's own tokens); drop model={self.model!r}")
        tp = self.draft_tensor_parallel_size
        if tp is not None and method not in MODEL_METHODS:
            raise ConfigError(f"draft_tensor_parallel_size is for a draft model; method "
                              f"{method!r} has none")
        if tp is not None and (not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"draft_tensor_parallel_size must be an integer >= 1, got {tp!r}")

    def _check_counts(self, method: str) -> None:
        k = self.num_speculative_tokens
        if k is None:
            if method != "suffix":
                raise ConfigError(f"speculative method {method!r} needs num_speculative_tokens "
                                  "(how many tokens to draft per step, e.g. 3)")
            return
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")

    def _check_ngram(self, method: str) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method != "ngram":
            if lo is not None or hi is not None:
                raise ConfigError(f"prompt_lookup_min / prompt_lookup_max are for method "
                                  f"'ngram', not {method!r}")
            return
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_suffix(self, method: str) -> None:
        given = [f for f in SUFFIX_FIELDS if getattr(self, f) is not None]
        if method != "suffix":
            if given:
                raise ConfigError(f"{given} are for method 'suffix', not {method!r}")
            return
        for name, default in SUFFIX_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
        depth = self.suffix_decoding_max_tree_depth
        if not isinstance(depth, int) or depth < 1:
            raise ConfigError(f"suffix_decoding_max_tree_depth must be >= 1, got {depth!r}")
        if self.suffix_decoding_max_cached_requests < 0:  # type: ignore[operator]
            raise ConfigError("suffix_decoding_max_cached_requests must be >= 0 (0: no cache)")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:  # type: ignore[operator]
            raise ConfigError("suffix_decoding_min_token_prob must lie in [0, 1]")
        if self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", depth)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """vLLM's forms: None, a dict, JSON text (`--speculative-config '{...}'`) or the dataclass."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--speculative-config must be a JSON object, got {value!r}: "
                              f"{exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("speculative_config must be a dict, JSON text or SpeculativeConfig, "
                          f"got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known - set(NO_EFFECT))
    if unknown:
        raise ConfigError(f"speculative_config: unknown field(s) {unknown}; known: "
                          f"{sorted(known)}")
    return SpeculativeConfig(**{k: v for k, v in value.items() if k in known})
