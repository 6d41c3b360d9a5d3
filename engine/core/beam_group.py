"""A beam search request in the engine core: its live beams are the request's sequences, sharing
the prompt's blocks and each other's common prefix by reference count. Each step, once every
live beam has its candidates, the best `beam_width` continuations are kept: a parent kept once
takes its token itself, kept again it forks (copy-on-write of the last partial block only), and
a parent not kept is freed at once. vLLM's rules: engine/sample/beam_search.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.outputs import CompletionOutput, Logprob
from kvserve.engine.sample.beam_search import BeamParams, beam_score, candidate_entry, choose


@dataclass
class Finished:
    """A completed beam: its output tokens (a final EOS included), score and logprobs."""

    tokens: list[int]
    cum_logprob: float
    logprobs: list[dict[int, Logprob]]
    finish_reason: str
    score: float


class BeamGroup:
    """The beams of one request (`state.seqs`, best first) and its completed ones."""

    def __init__(self, state: Any, params: BeamParams, eos_id: int | None) -> None:
        self.state = state  # the core's RequestState
        self.width, self.length_penalty = params.beam_width, params.length_penalty
        self.eos_id = eos_id  # vLLM's tokenizer.eos_token_id: the score leaves it out
        self.stop_eos = None if params.ignore_eos else eos_id
        self.completed: list[Finished] = []
        self.reports: dict[int, tuple[list[float], list[int]]] = {}
        self.steps = 0
        self.done = False

    def live(self) -> list[Sequence]:
        return [s for s in self.state.seqs if not s.is_finished]

    def report(self, core: Any, seq: Sequence, vals: list[float], ids: list[int]) -> None:
        """A beam's 2 * width candidates; the step is taken when every live beam has its own
        (a beam the scheduler left out this step waits, with nothing to compute, until then)."""
        self.reports[seq.seq_id] = (vals, ids)
        live = self.live()
        if all(s.seq_id in self.reports for s in live):
            self._advance(core, live)

    def _advance(self, core: Any, live: list[Sequence]) -> None:
        vals = torch.tensor([self.reports[s.seq_id][0] for s in live], dtype=torch.float64)
        ids = torch.tensor([self.reports[s.seq_id][1] for s in live])
        cum = torch.tensor([s.cumulative_logprob for s in live], dtype=torch.float64)
        self.reports = {}
        self.steps += 1
        choice = choose(cum, vals, ids, self.width, self.stop_eos)
        entries = [candidate_entry(v, t) for v, t in zip(vals.tolist(), ids.tolist())]
        for b, j in choice.finished:
            self._complete(live[b].output_token_ids + [int(ids[b, j])],
                           float(cum[b] + vals[b, j]), (live[b].logprobs or []) + [entries[b]],
                           "stop", live[b].num_prompt_tokens)
        beams = self._place(core, live, [b for b, _ in choice.kept])
        for seq, (b, j) in zip(beams, choice.kept):
            seq.output_token_ids.append(int(ids[b, j]))
            seq.cumulative_logprob = float(cum[b] + vals[b, j])
            seq.logprobs = (seq.logprobs or []) + [entries[b]]
        core.generation_tokens += len(beams)
        if not beams or self._at_length(core, beams[0]):
            self.finish(core)

    def _place(self, core: Any, live: list[Sequence], parents: list[int]) -> list[Sequence]:
        """The seq of each kept candidate (best first): its parent the first time, a fork of it
        after; every fork is taken before any token is appended; unkept parents are freed."""
        out: list[Sequence] = []
        used: set[int] = set()
        for b in parents:
            out.append(fork(core, live[b]) if b in used else live[b])
            used.add(b)
        for b, seq in enumerate(live):
            if b not in used:
                core.scheduler.finish(seq)
        for i, seq in enumerate(out):
            seq.index = i
        self.state.seqs[:] = out or live[:1]  # none kept (a tiny vocabulary): the group ends
        return out

    def _at_length(self, core: Any, seq: Sequence) -> bool:
        return len(seq.output_token_ids) >= seq.params.max_tokens \
            or seq.num_tokens >= core.max_model_len  # type: ignore[operator]

    def _complete(self, tokens: list[int], cum: float, logprobs: list[dict[int, Logprob]],
                  reason: str, prompt_len: int) -> None:
        """Keep a completed beam if it is among the `width` best so far (only those can be
        returned: a completed beam's score never changes)."""
        ends_eos = bool(tokens) and tokens[-1] == self.eos_id
        score = beam_score(prompt_len + len(tokens), cum, ends_eos, self.length_penalty)
        self.completed.append(Finished(tokens, cum, logprobs, reason, score))
        self.completed.sort(key=lambda f: f.score, reverse=True)  # stable: earlier first on ties
        del self.completed[self.width:]

    def finish(self, core: Any) -> None:
        """The live beams complete by length and release their blocks; the group is done."""
        for seq in self.live():
            self._complete(list(seq.output_token_ids), seq.cumulative_logprob,
                           list(seq.logprobs or []), "length", seq.num_prompt_tokens)
            seq.finish_reason = "length"
            core.scheduler.finish(seq)
        self.done = True
        self.state.metrics.finished_time = time.monotonic()


def fork(core: Any, parent: Sequence) -> Sequence:
    """A new beam sharing every block of `parent` (ref counts), running at once."""
    child = core.new_seq(parent.request_id, parent.index, parent.prompt_token_ids,
                         parent.params, parent.arrival_time, parent.priority,
                         parent.cache_salt, parent.lora_name)
    child.num_computed_tokens = parent.num_computed_tokens
    child.num_cached_tokens = parent.num_cached_tokens
    child.output_token_ids = list(parent.output_token_ids)
    child.cumulative_logprob = parent.cumulative_logprob
    child.logprobs = list(parent.logprobs or [])
    child.group = parent.group
    if parent.status != SequenceStatus.RUNNING:  # preempted: it recomputes, as its parent will
        child.num_computed_tokens = 0
        core.scheduler.add(child)
        return child
    core.kv.fork(parent, child)
    core.scheduler.add_running(child)
    return child


def members(seq: Sequence) -> list[Sequence]:
    """The seqs the scheduler admits and preempts together with `seq`: its live beams."""
    group = seq.group
    return [seq] if group is None else [s for s in group.live()] or [seq]


def future_beams(seq: Sequence) -> int:
    """Seqs a beam group's first seq will fork after its prefill (admission counts them)."""
    group = seq.group
    return group.width - 1 if group is not None and group.steps == 0 else 0


def beam_outputs(group: BeamGroup, tokenizer: Any, skip_special_tokens: bool
                 ) -> list[CompletionOutput]:
    """The request's outputs: done, the best `width` completed beams, best first (vLLM's
    serving: token ids with a final EOS, text without it); else the live beams as they stand."""
    if not group.done:
        return [CompletionOutput(i, "", list(s.output_token_ids), s.cumulative_logprob,
                                 list(s.logprobs or []), s.finish_reason, s.stop_reason)
                for i, s in enumerate(group.state.seqs)]
    outs = []
    for i, f in enumerate(group.completed):
        shown = f.tokens[:-1] if f.finish_reason == "stop" else f.tokens
        text = tokenizer.decode(shown, skip_special_tokens=skip_special_tokens)
        outs.append(CompletionOutput(i, text, list(f.tokens), f.cum_logprob, f.logprobs,
                                     f.finish_reason, None))
    return outs


def beam_eos(core: Any) -> int | None:
    """vLLM's beam EOS: the tokenizer's `eos_token_id` (else the model's lowest EOS id)."""
    eos = getattr(core.tokenizer, "eos_token_id", None)
    if eos is None and core.eos_token_ids:
        eos = min(core.eos_token_ids)
    return eos


def group_fits(seq: Sequence, waiting: Any, free_blocks: int, block_size: int) -> bool:
    """Whether the pool can take back every waiting beam of `seq`'s group (none of them
    running: a group is admitted whole, so no beam sits holding blocks for a sibling that cannot
    come in) with a block each to grow or copy into, and a first seq its future forks' blocks.
    An upper bound: prefix-cache hits only lower it."""
    group = seq.group
    if group is None or any(s.status == SequenceStatus.RUNNING for s in group.live()):
        return True
    back = [s for s in waiting if s.group is group]
    need = sum(-(-s.num_tokens // block_size) + 1 for s in back) + future_beams(seq)
    return need <= free_blocks
