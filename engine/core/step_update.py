"""The step's update from the model's output (vLLM's `update_from_output`): each sampled token
joins its sequence (n > 1 siblings fork first), with its logprobs, metrics, text and the finish
rules (stop tokens, EOS, stop strings, length, a terminated grammar). `core` is the
`EngineCore` (engine/core/engine_core.py) that owns the requests."""

from __future__ import annotations

import time
from typing import Any

from kvserve.engine.core.request import RequestState
from kvserve.engine.core.sampling_inputs import grammar_state
from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.outputs import Logprob
from kvserve.engine.sample.sampler import SamplerOutput


def apply_samples(core: Any, sched: SchedulerOutput, rows: list[int], result: SamplerOutput,
                  now: float, tokens: list[int], after: list[list[int] | None]
                  ) -> list[RequestState]:
    """Append each sampled row's token (`tokens`, read from `result`) to its seq, forking n > 1
    siblings first; `after[r]`: placeholders of a later step in flight, put back behind row r's
    token unless it finished the seq (engine/async_scheduling.py). Returns the requests moved."""
    lps = result.logprobs.tolist() if result.logprobs is not None else None
    lp_ids = result.logprob_token_ids.tolist() if result.logprob_token_ids is not None else None
    ranks = result.sampled_token_ranks.tolist() if result.sampled_token_ranks is not None else None
    # Forks first: a parent that finishes on this very token must still lend its blocks.
    targets: list[Sequence] = []
    for r, i in enumerate(rows):
        parent = sched.seqs[i]
        targets.append(fork(core, parent) if r > 0 and rows[r - 1] == i else parent)
    touched: dict[str, RequestState] = {}
    for r, (seq, tok) in enumerate(zip(targets, tokens)):
        if seq.is_finished or seq.request_id not in core.requests:
            continue  # ended (aborted, or stopped by the step before) while in flight
        state = core.requests[seq.request_id]
        if state.beam is not None:  # a beam's candidates: its group chooses (core/beam_group.py)
            if _beam_report(core, state, seq, lps[r] if lps else [], lp_ids[r] if lp_ids else []):
                touched[state.request_id] = state
            continue
        try:  # detokenizing and stop checks are this request's own business
            append_token(core, state, seq, tok, now,
                         (lps[r], lp_ids[r]) if lps and lp_ids else None,
                         ranks[r] if ranks else None)
        except Exception as exc:  # noqa: BLE001 - handed to that request's caller
            core.fail_request(seq.request_id, exc)
        if after[r] and not seq.is_finished:
            seq.output_token_ids += after[r]
        touched[state.request_id] = state
    return list(touched.values())


def _beam_report(core: Any, state: RequestState, seq: Sequence, lp: list[float],
                 lp_ids: list[int]) -> bool:
    """Hand a beam's top 2 * width candidates to its group; True once the group is done."""
    now = time.monotonic()
    if state.metrics.first_token_time is None:
        state.metrics.first_token_time = now
    state.metrics.last_token_time = now
    try:
        state.beam.report(core, seq, lp[1:], lp_ids[1:])
    except Exception as exc:  # noqa: BLE001 - handed to that request's caller
        core.fail_request(seq.request_id, exc)
    return bool(state.beam.done)


def fork(core: Any, parent: Sequence) -> Sequence:
    """An n > 1 sibling of `parent`: its progress, its blocks (shared), its own text."""
    state = core.requests[parent.request_id]
    parent.pending_forks -= 1
    child = core.new_seq(parent.request_id, len(state.seqs), parent.prompt_token_ids,
                         parent.params, parent.arrival_time, parent.priority,
                         parent.cache_salt, parent.lora_name)
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    child.output_token_ids = list(parent.output_token_ids)
    child.prompt_embeds = parent.prompt_embeds  # a recompute re-feeds them
    core.kv.fork(parent, child)
    core.scheduler.add_running(child)
    state.seqs.append(child)
    state.detoks.append(state.new_text())
    return child


def append_token(core: Any, state: RequestState, seq: Sequence, tok: int, now: float,
                 lp: tuple[list[float], list[int]] | None, rank: int | None) -> None:
    """One sampled token: logprobs, metrics, text; finish the seq if a rule says so."""
    seq.output_token_ids.append(tok)
    core.generation_tokens += 1
    if state.metrics.first_token_time is None:
        state.metrics.first_token_time = now
    state.metrics.last_token_time = now
    if lp is not None and seq.params.logprobs is not None:
        _append_logprobs(seq, lp[0], lp[1], rank)
    grammar = grammar_state(core, seq)  # advanced; a forbidden token fails the request
    stop_str = state.detoks[seq.index].update(seq.output_token_ids)
    reason = finish_reason(seq, tok, stop_str, core.eos_token_ids, core.max_model_len)
    if reason is None and grammar is not None and grammar.is_terminated \
            and not seq.params.ignore_eos:
        reason = ("stop", None)  # the grammar took EOS: nothing may follow, min_tokens or not
    if reason is not None:
        if stop_str is None:
            state.detoks[seq.index].flush(seq.output_token_ids)
        seq.finish_reason, seq.stop_reason = reason
        core.scheduler.finish(seq)
        if state.finished:
            state.metrics.finished_time = now


def _append_logprobs(seq: Sequence, lp: list[float], lp_ids: list[int], rank: int | None
                     ) -> None:
    k = seq.params.logprobs
    seq.cumulative_logprob += lp[0]
    if seq.logprobs is None:
        seq.logprobs = []
    # vLLM's {token_id: Logprob}: the top-k ranked 1..k, then the sampled token (whose rank the
    # sampler counted over the whole vocabulary) wins its own key
    entry = {t: Logprob(v, i + 1) for i, (t, v) in enumerate(
        zip(lp_ids[1 : k + 1], lp[1 : k + 1]))}  # type: ignore[operator]
    entry[lp_ids[0]] = Logprob(lp[0], rank)  # type: ignore[arg-type]
    seq.logprobs.append(entry)


def finish_reason(seq: Sequence, tok: int, stop_str: str | None, eos_token_ids: Any,
                  max_model_len: int) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) once `tok` ends the seq, else None."""
    p = seq.params
    n_out = len(seq.output_token_ids)
    if stop_str is not None:
        return "stop", stop_str
    if n_out >= p.min_tokens:
        if tok in p.stop_token_ids:  # type: ignore[operator]
            return "stop", tok
        if not p.ignore_eos and tok in eos_token_ids:
            return "stop", None
    if n_out >= p.max_tokens or seq.num_tokens >= max_model_len:  # type: ignore[operator]
        return "length", None
    return None
