"""Structured outputs: constraints compiled to token-level matchers by a grammar backend, cached
by constraint, and the per-step bitmask of the constrained rows of a batch.

Two backends sit behind one small interface (`GrammarBackend`, backend.py): xgrammar
(backend_xgrammar.py) and llguidance, "guidance" (backend_guidance.py). "auto" (the
default, as vLLM's) compiles with xgrammar and falls back to guidance for what xgrammar refuses
(and for a whitespace_pattern, which only guidance has); a constraint both refuse gets
xgrammar's message. Both write the same bitmask (bit t of the row allows token t), so one batch
may mix them and one kernel applies it.

Compiling is thread-safe and may run off the engine thread (the AsyncEngine compiles before it
queues a request, so a slow schema never stalls the step loop and a bad one is refused before it
is queued). Matchers belong to one sequence each and are driven by the engine thread only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.structured_output.backend import GrammarBackend
from kvserve.engine.structured_output.backend_guidance import GuidanceBackend
from kvserve.engine.structured_output.backend_xgrammar import XGrammarBackend, xgr
from kvserve.engine.structured_output.params import StructuredOutputsParams

BACKENDS = ("auto", "xgrammar", "guidance")


class Compiled:
    """A compiled constraint and the backend that made it (its matchers come from there)."""

    def __init__(self, backend: GrammarBackend, value: Any) -> None:
        self.backend, self.value = backend, value


class GrammarCompiler:
    """Compile `StructuredOutputsParams` for one tokenizer with the engine's backend ("auto",
    "xgrammar" or "guidance"; a request may name its own); an LRU cache keyed by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = 256, max_threads: int = 2, backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured output backend must be one of {BACKENDS}, got "
                             f"{backend!r}")
        self.backend = backend
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self._cache: OrderedDict[tuple, Compiled] = OrderedDict()
        self._cache_size = cache_size
        self._max_threads = max_threads
        self._lock = threading.Lock()
        self._backends: dict[str, GrammarBackend] = {}
        self.hits = 0
        self.misses = 0

    def _get(self, name: str) -> GrammarBackend:
        """The named backend, made on first use (each reads the tokenizer's whole vocabulary)."""
        with self._lock:
            if name not in self._backends:
                cls = XGrammarBackend if name == "xgrammar" else GuidanceBackend
                self._backends[name] = cls(self._tokenizer, self.vocab_size,
                                           self._stop_token_ids, self._max_threads)
            return self._backends[name]

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        """The compiled grammar (cached); InvalidRequestError naming the field for a schema,
        regex or grammar that does not compile."""
        params.verify()
        choice = params.backend if params.backend not in (None, "auto") else self.backend
        key = (choice, *params.cache_key())
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return self._cache[key]
        compiled = self._compile(params, choice)
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams, choice: str) -> Compiled:
        if choice == "auto" and params.whitespace_pattern is not None:
            choice = "guidance"
        if choice != "auto":
            backend = self._get(choice)
            return Compiled(backend, backend.compile(params))
        primary = self._get("xgrammar")
        try:
            return Compiled(primary, primary.compile(params))
        except InvalidRequestError as refused:
            fallback = self._get("guidance")
            try:
                return Compiled(fallback, fallback.compile(params))
            except InvalidRequestError:
                raise refused from None

    def matcher(self, compiled: Compiled) -> GrammarState:
        return GrammarState(compiled.backend.matcher(compiled.value), compiled.backend)

    def token_bitmask(self, states: Sequence[GrammarState | None]
                      ) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask) for the rows that have a live grammar; None when no row has one.

        The bitmask has one int32 row per batch row, left unfilled (never read) for rows without
        a grammar: the apply kernel reads only the listed rows, so the others cost nothing. Each
        backend fills its rows in one call (its own threads, no Python loop over tokens).
        """
        rows = [i for i, s in enumerate(states) if s is not None and not s.is_terminated]
        if not rows:
            return None
        bitmask = torch.empty((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32)
        _fill(states, rows, bitmask)
        return rows, bitmask

    def draft_token_bitmask(self, states: Sequence[GrammarState | None],
                            prefixes: Sequence[Sequence[int]]
                            ) -> tuple[tuple[list[int], torch.Tensor] | None, list[int]]:
        """`token_bitmask` for speculative decoding's scored positions: row i is filled from
        its matcher once taken past `prefixes[i]` (the drafts before that position). The rows
        of one matcher must have nested prefixes (a seq's drafts[:j]); they are filled depth by
        depth, each depth in one call per backend, and every matcher is rolled back at the end.

        Also returns, per row, how many of its prefix the grammar took: fewer than all means
        a draft in it is refused, and the row is left unconstrained (its sample is never kept:
        the target's sample at the refused position differs from the draft)."""
        reached = [len(p) for p in prefixes]
        walks: dict[int, list[int]] = {}  # one walk per matcher: its rows
        for i, s in enumerate(states):
            if s is not None and not s.is_terminated:
                walks.setdefault(id(s), []).append(i)
        if not walks:
            return None, reached
        bitmask = torch.empty((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32)
        rows: list[int] = []
        owner: dict[int, GrammarState] = {w: states[r[0]] for w, r in walks.items()}  # type: ignore
        paths = {w: list(max((prefixes[i] for i in r), key=len)) for w, r in walks.items()}
        taken = dict.fromkeys(walks, 0)  # tokens of its path each matcher has taken
        try:
            for depth in range(max(len(p) for p in paths.values()) + 1):
                now = [i for w, r in walks.items() for i in r if len(prefixes[i]) == depth
                       and taken[w] == depth and not owner[w].is_terminated]
                _fill(states, now, bitmask)
                rows += now
                for w, path in paths.items():
                    if taken[w] == depth < len(path):
                        taken[w] += owner[w].advance(path[depth:depth + 1])
        finally:
            for state in owner.values():
                state.retreat()
        for w, r in walks.items():
            for i in r:
                reached[i] = min(reached[i], taken[w])
        return (sorted(rows), bitmask) if rows else None, reached


def _fill(states: Sequence[GrammarState | None], rows: list[int], bitmask: torch.Tensor) -> None:
    """Fill `rows` of `bitmask` from their states' matchers, one call per backend. A sequence
    about to fork appears once per sample in the batch: its matcher is filled once (the
    filler's threads must never share a matcher) and that row copied to the others."""
    first: dict[int, int] = {}
    for i in rows:
        first.setdefault(id(states[i]), i)
    by_backend: dict[str, list[int]] = {}
    for i in sorted(first.values()):
        by_backend.setdefault(states[i].backend.name, []).append(i)  # type: ignore[union-attr]
    for unique in by_backend.values():
        backend = states[unique[0]].backend  # type: ignore[union-attr]
        backend.fill_bitmask([states[i].matcher for i in unique], bitmask,  # type: ignore
                             unique)
    for i in rows:
        if first[id(states[i])] != i:
            bitmask[i] = bitmask[first[id(states[i])]]


class GrammarState:
    """One sequence's matcher, kept equal to the sequence's output tokens by `sync`."""

    def __init__(self, matcher: Any, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend
        self.tokens: list[int] = []  # the tokens the matcher has accepted, in order
        self._ahead = 0  # tokens `advance` took beyond `tokens` (drafts), until `retreat`

    def sync(self, output_token_ids: list[int]) -> None:
        """Accept the tokens the sequence has and the matcher lacks; roll back any the sequence
        no longer has (a preemption that dropped tokens). ValueError on a token the grammar
        forbids, which the mask makes impossible unless the sequence was edited."""
        self.retreat()
        common = 0
        limit = min(len(self.tokens), len(output_token_ids))
        while common < limit and self.tokens[common] == output_token_ids[common]:
            common += 1
        extra = len(self.tokens) - common
        if extra:
            self.matcher.rollback(extra)
            del self.tokens[common:]
        for tok in output_token_ids[common:]:
            if self.matcher.is_terminated():
                self.tokens.append(tok)  # past the end (ignore_eos): nothing left to check
                continue
            if not self.matcher.accept_token(tok):
                raise ValueError(f"token {tok} is not allowed by the request's grammar here")
            self.tokens.append(tok)

    def advance(self, tokens: Sequence[int]) -> int:
        """Take the matcher past `tokens` (speculative drafts) as far as the grammar allows,
        without counting them as the sequence's: how many were taken (all of those past the
        grammar's end, as `sync` lets them through). `retreat` undoes it."""
        taken, tokens = 0, list(tokens)
        while taken < len(tokens) and not self.matcher.is_terminated():
            n = self.backend.accept_prefix(self.matcher, tokens[taken:])
            if n == 0:
                return taken
            taken += n
            self._ahead += n
        return len(tokens)

    def retreat(self) -> None:
        """Back to the sequence's own tokens (undo `advance`)."""
        if self._ahead:
            self.matcher.rollback(self._ahead)
            self._ahead = 0

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows from here (the matcher is left as is)."""
        try:
            return self.advance(tokens)
        finally:
            self.retreat()

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor
                        ) -> torch.Tensor:
    """A copy of `logits` with the tokens each listed row's grammar forbids at -inf: one kernel
    call over those rows (xgrammar's CPU, CUDA or Triton kernel, whichever backend filled the
    mask), no Python loop over tokens."""
    out = logits.clone()
    xgr().apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                      vocab_size=min(out.shape[-1], bitmask.shape[-1] * 32),
                                      indices=rows)
    return out
