"""The grammar backend (xgrammar): constraints compiled to token-level matchers, cached by
constraint, and the per-step bitmask of the constrained rows of a batch.

Compiling is thread-safe and may run off the engine thread (the AsyncEngine compiles before it
queues a request, so a slow schema never stalls the step loop and a bad one is refused before it
is queued). Matchers belong to one sequence each and are driven by the engine thread only.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.guided_params import StructuredOutputsParams

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# xgrammar 0.2 writes the characters of a length-bounded string as "anything but a quote, a
# backslash or a line break", which lets raw control characters through: invalid JSON. Its
# unbounded strings use the right class; the bounded ones are given the same.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\]'
_PARAM = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
          "grammar": "guided_grammar", "json_object": "response_format"}


def _xgr() -> Any:
    """xgrammar, imported on first use: engines that never see a constraint never load it."""
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of kvserve
        raise InvalidRequestError("structured outputs need the xgrammar package "
                                  "(pip install xgrammar)", param="structured_outputs") from exc
    return xgrammar


class GrammarCompiler:
    """Compile `StructuredOutputsParams` for one tokenizer; an LRU cache keyed by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256, max_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._cache_size = cache_size
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._filler: Any = None  # xgrammar's batch bitmask filler, engine thread only
        self.hits = 0
        self.misses = 0

    def _backend(self) -> Any:
        """The xgrammar compiler; building the tokenizer's vocabulary table costs a moment,
        so it happens on the first constrained request, not at engine start."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self._stop_token_ids or None)
                # Our own cache holds the results; xgrammar's would keep a second copy.
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads,
                                                     cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached); InvalidRequestError naming the field for a schema,
        regex or grammar that does not compile."""
        params.verify()
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        compiled = self._compile(params, self._backend())
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams, compiler: Any) -> Any:
        kind = params.kind
        compact = params.compact_whitespace
        try:
            if kind in ("json", "json_object"):
                # json_object is OpenAI's: an object, any keys (hence not strict).
                schema = json.dumps(params.schema()) if kind == "json" else '{"type": "object"}'
                grammar = _xgr().Grammar.from_json_schema(
                    schema, any_whitespace=not compact, strict_mode=kind == "json")
                return compiler.compile_grammar(str(grammar).replace(_LOOSE_CHAR, _JSON_CHAR))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice or []))
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            what = {"json": "JSON schema", "json_object": "JSON object grammar"}.get(kind, kind)
            raise InvalidRequestError(f"the {what} cannot be used: {_clean(exc)}",
                                      param=params.source or _PARAM[kind]) from None

    def token_bitmask(self, states: Sequence[GrammarState | None]
                      ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask) for the rows that have a live grammar; None when no row has one.

        The bitmask has one int32 row per batch row, left unfilled (never read) for rows without
        a grammar: the apply kernel reads only the listed rows, so the others cost nothing. The
        rows are filled by xgrammar's batch filler (its own threads, no Python loop over tokens).
        """
        rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated]
        if not rows:
            return None
        if self._filler is None:
            self._filler = _xgr().BatchGrammarMatcher(max_threads=self._max_threads)
        bitmask = torch.empty((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32)
        # A sequence about to fork appears once per sample in the batch: fill its matcher once
        # (the filler's threads must never share a matcher) and copy that row to the others.
        first: dict[int, int] = {}
        for i in rows:
            first.setdefault(id(states[i]), i)
        unique = sorted(first.values())
        self._filler.batch_fill_next_token_bitmask(
            [states[i].matcher for i in unique], bitmask, indices=unique)  # type: ignore[union-attr]
        for i in rows:
            if first[id(states[i])] != i:
                bitmask[i] = bitmask[first[id(states[i])]]
        return rows, bitmask

    def matcher(self, compiled: Any) -> GrammarState:
        return GrammarState(_xgr().GrammarMatcher(compiled))


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of `choices` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(exc: BaseException) -> str:
    """xgrammar's C++ message without its log prefix (time, source file and line)."""
    text = str(exc).strip()
    return _LOG_PREFIX.sub("", text).splitlines()[0] if text else type(exc).__name__


class GrammarState:
    """One sequence's matcher, kept equal to the sequence's output tokens by `sync`."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.tokens: list[int] = []  # the tokens the matcher has accepted, in order

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the tokens the sequence has and the matcher lacks; roll back any the sequence
        no longer has (a preemption that dropped tokens). ValueError on a token the grammar
        forbids, which the mask makes impossible unless the sequence was edited."""
        common = 0
        limit = min(len(self.tokens), len(output_token_ids))
        while common < limit and self.tokens[common] == output_token_ids[common]:
            common += 1
        extra = len(self.tokens) - common
        if extra:
            self.matcher.rollback(extra)  # xgrammar keeps the whole history: any depth works
            del self.tokens[common:]
        for tok in output_token_ids[common:]:
            if self.matcher.is_terminated():
                self.tokens.append(tok)  # past the end (ignore_eos): nothing left to check
                continue
            if not self.matcher.accept_token(tok):
                raise ValueError(f"token {tok} is not allowed by the request's grammar here")
            self.tokens.append(tok)

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
                        ) -> torch.Tensor:
    """A copy of `logits` with the tokens each listed row's grammar forbids at -inf: one kernel
    call over those rows (xgrammar's CPU, CUDA or Triton kernel), no Python loop over tokens."""
    out = logits.clone()
    _xgr().apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                       vocab_size=min(out.shape[-1], bitmask.shape[-1] * 32),
                                       indices=rows)
    return out
