"""best_of: sample `best_of` candidates, return the `n` with the highest cumulative logprob (vLLM's
and OpenAI's legacy semantics). The engine runs the candidates as an ordinary n = best_of request
with logprobs on (the ranking needs them) and only shows the chosen ones, once all are done."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from kvserve.engine.outputs import CompletionOutput
from kvserve.engine.sample.sampling_params import SamplingParams


@dataclass(frozen=True)
class BestOf:
    n: int  # how many the caller asked for
    logprobs: int | None  # the caller's own logprobs setting (None: strip them)


def expand(params: SamplingParams) -> tuple[SamplingParams, BestOf | None]:
    """(the params the engine runs, the selection to apply) — unchanged when best_of <= n."""
    if params.best_of is None or params.best_of <= params.n:
        return params, None
    inner = copy.copy(params)
    inner.n, inner.logprobs = params.best_of, params.logprobs or 0
    return inner, BestOf(params.n, params.logprobs)


def select(outputs: list[CompletionOutput], finished: bool, best: BestOf
           ) -> list[CompletionOutput]:
    """Nothing until every candidate is done; then the best n, re-indexed 0..n-1."""
    if not finished:
        return []
    ranked = sorted(outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[:best.n]
    chosen = []
    for i, o in enumerate(ranked):
        o = copy.copy(o)
        o.index = i
        if best.logprobs is None:
            o.logprobs, o.cumulative_logprob = None, None
        chosen.append(o)
    return chosen
