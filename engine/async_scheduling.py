"""Async scheduling (vLLM's `--async-scheduling`): schedule and launch step N+1 before reading
step N's sampled tokens, so the host's scheduling, input preparation and kernel launches run while
the device still computes step N.

How a step is split (`OverlappedStep` drives `EngineCore`'s schedule, execute_model and
update_from_output, engine/core/engine_core.py):
- **launch**: schedule, build the inputs, run the forward and the sampler without reading
  anything back; advance each scheduled seq's computed count and give every sampled seq a
  placeholder token (`PLACEHOLDER`), so the next schedule already counts the token it will have.
- **lookahead**: while step N is in flight, the next step is scheduled with no preemption (a
  seq whose token is in flight must keep its blocks) and without the seqs that step N surely
  finishes (max_tokens, max_model_len). A decode row's input token is the placeholder; the model
  runner copies it on the device from step N's sampled ids (`StepFill`), never through the host.
- **finish**: read step N's tokens (the one host sync), write them over the placeholders,
  register the newly full blocks in the prefix cache (only now are their tokens known), then run
  the usual per-token work: logprobs, detokenising, stop checks. A seq that step N finished by
  EOS or a stop string was already scheduled in step N+1: that row's token is dropped and its
  blocks freed now (the device runs queued work in order, so nothing later reads them first).

Overlap needs requests whose sampling does not read the tokens in flight; a step holding any
other request runs synchronously (launch, then finish): penalties and structured outputs read
the output tokens, prompt logprobs and n > 1 forks the exact progress of each seq, custom logits
processors the whole token history. Tensor-parallel engines run synchronously too (every rank
would need the sampled ids).

Speculative decoding with a host-side proposer (ngram, suffix; EngineConfig refuses the others
with async scheduling, and they run in turn when it is on by default): a verification step is
finished before the next step is scheduled, since the next positions depend on how many drafts
it accepts and the next drafts on its tokens. A step without drafts (the proposer found none,
`disable_by_batch_size`, adaptive lengths at 0) asks the proposer, while its forward runs, over
the tokens known so far (Speculator.would_draft): if it would draft for nobody, the next step
launches ahead as above (drafting nothing); otherwise that step waits and gets drafts over
every token. So what overlaps is the plain decode steps, and the proposer's probe overlaps
the forward; verification steps run as without async scheduling, and the outputs are the same
token for token. On a CPU the forward runs inside the launch, so nothing overlaps:
the mode is on by default only on a GPU (`async_scheduling=None`), and the tests force it on a
CPU to check that it yields exactly the synchronous tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence


# The token id of a sampled seq whose token is still on the device (never a vocabulary id: an
# input row that kept it would fail the embedding lookup instead of computing garbage).
PLACEHOLDER = -1


@dataclass
class StepFill:
    """Input tokens the device supplies: flat input position `index[i]` takes
    `tokens[source[i]]` (the previous step's sampled ids, still on the device)."""

    index: list[int]
    source: list[int]
    tokens: torch.Tensor


@dataclass
class InFlight:
    """A launched step whose sampled tokens are not read yet."""

    sched: SchedulerOutput
    launched: Any  # EngineCore.execute_model's ModelStep: sampled rows, sampler output
    t0: float
    # each sampled row's seq and the index of its placeholder in the seq's output_token_ids
    placeholders: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def overlappable(self) -> bool:
        """Whether the next step may launch before this one's tokens are read: no prompt
        logprobs to append, no n > 1 parent that forks on this step's tokens."""
        rows = self.launched.rows
        return self.launched.prompt_plan is None and len(set(rows)) == len(rows)


def enabled(asked: bool | None, engine: Any) -> bool:  # engine: an EngineCore
    """`async_scheduling` as configured: None is on for a single-rank engine on a GPU (where
    the forward is asynchronous), off elsewhere; True forces it (EngineConfig refuses it with
    tensor parallelism)."""
    single = engine.runner.workers is None
    if asked is None:
        return single and engine.device.type == "cuda"
    return bool(asked) and single


def request_overlaps(state: Any) -> bool:
    """Whether a request's sampling can run a step ahead of its tokens (see the module doc)."""
    p = state.params
    return (state.grammar is None and p.n == 1 and state.best_of is None and state.beam is None
            and p.prompt_logprobs is None and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0)


class OverlappedStep:
    """`EngineCore.step`'s driver: launch (schedule + execute), then finish (update from output);
    with async scheduling (`overlap`) the next step is launched before the current one
    finishes, so at most one step is in flight between calls."""

    def __init__(self, core: Any, overlap: bool) -> None:  # an EngineCore
        self.core = core
        self.overlap = overlap  # False: every step is launched and finished in one call
        self.inflight: InFlight | None = None
        self.overlapped_steps = 0  # steps launched while the previous one was in flight

    def step(self) -> list[Any]:
        """The requests (the core's RequestStates) that moved in the step finished now."""
        self._drop_if_dead()  # its requests were aborted since the last call
        if self.inflight is None:
            self.inflight = self._launch(lookahead=None)
            if self.inflight is None:
                return []
        current, self.inflight = self.inflight, None
        if current.overlappable and self._may_overlap(current):
            self.inflight = self._launch(lookahead=current)
            if self.inflight is not None:
                self.overlapped_steps += 1
        moved = self._finish(current)
        self._drop_if_dead()  # every seq in it ended meanwhile: nothing to wait for
        return moved

    def _drop_if_dead(self) -> None:
        """Finish and forget a step in flight whose seqs have all ended (it yields nothing; its
        time is not a step's, so the swap cost model does not see it)."""
        if self.inflight is not None and all(s.is_finished for s in self.inflight.sched.seqs):
            self._finish(self.inflight, observe=False)
            self.inflight = None

    def drain(self) -> None:
        """Finish the step in flight (before anything that changes the scheduler's or the
        adapters' state outside a step); its requests come with the next `step()`."""
        if self.inflight is None:
            return
        current, self.inflight = self.inflight, None
        self.core.pending += self._finish(current)

    def _may_overlap(self, current: InFlight) -> bool:
        core = self.core
        if not (self.overlap and core.logits_processors is None
                and all(request_overlaps(s) for s in core.requests.values())):
            return False
        return core.spec is None or self._spec_allows(current)

    def _spec_allows(self, current: InFlight) -> bool:
        """With speculative decoding (see the module doc): a verification step in flight
        runs in turn (the next positions follow its accepted count), and so does the next step
        when the proposer, asked over the known tokens, would draft for it."""
        spec = self.core.spec
        if not spec.overlaps or current.launched.spec is not None:
            return False
        return not spec.would_draft(self.core)

    def _launch(self, lookahead: InFlight | None) -> InFlight | None:
        """Schedule and launch one step. With `lookahead` (the step in flight) nothing is
        preempted, the seqs it surely finishes sit out, and its placeholders become device
        fills."""
        core = self.core
        t0 = time.perf_counter()
        skip = _sure_to_finish(lookahead, core.max_model_len) if lookahead is not None else None
        sched = core.schedule(skip)
        if sched is None:
            return None
        fill = _fill(sched, lookahead) if lookahead is not None else None
        launched = core.execute_model(sched, fill)
        placeholders: list[tuple[Sequence, int]] = []
        if launched.result is not None and launched.spec is None:
            for r, i in enumerate(launched.rows):
                seq = sched.seqs[i]
                if r > 0 and launched.rows[r - 1] == i:  # an n > 1 fork's row: appends on finish
                    placeholders.append((seq, -1))
                    continue
                seq.output_token_ids.append(PLACEHOLDER)
                placeholders.append((seq, len(seq.output_token_ids) - 1))
        return InFlight(sched, launched, t0, placeholders)

    def _finish(self, step: InFlight, observe: bool = True) -> list[Any]:
        """Read the step's tokens, put them in place of the placeholders, and hand them to
        the core's update (see the module doc)."""
        core = self.core
        result = step.launched.result
        tokens = result.sampled_token_ids.tolist() if result is not None else []
        live = [not s.is_finished and s.request_id in core.requests for s, _ in step.placeholders]
        for (seq, k), tok, ok in zip(step.placeholders, tokens, live):
            if ok and k >= 0:
                seq.output_token_ids[k] = tok
        drafted = {step.sched.seqs[g.batch_index].seq_id
                   for g in (step.launched.spec.groups if step.launched.spec else [])}
        for seq in step.sched.seqs:  # every computed token is known now: cache the full blocks
            # (a drafted seq's are registered once its drafts are verified: spec_decode/)
            if not seq.is_finished and seq.request_id in core.requests \
                    and seq.seq_id not in drafted:
                core.kv.register_computed(seq)
        # Each token is applied as the sync engine appends it: the seq's outputs end just
        # before it (a later step's placeholder comes back after, unless the seq finished).
        after: list[list[int] | None] = []
        for (seq, k), ok in zip(step.placeholders, live):
            after.append(seq.output_token_ids[k + 1:] if ok and k >= 0 else None)
            if ok and k >= 0:
                del seq.output_token_ids[k:]
        seconds = time.perf_counter() - step.t0 if observe else None
        return core.update_from_output(step.sched, step.launched, tokens, after, seconds)


def _sure_to_finish(step: InFlight, max_model_len: int) -> set[int]:
    """seq_ids that the step in flight ends by length whatever its token is."""
    out: set[int] = set()
    for seq, _ in step.placeholders:
        p = seq.params
        if (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) \
                or seq.num_tokens >= max_model_len:
            out.add(seq.seq_id)
    return out


def _fill(sched: SchedulerOutput, prev: InFlight) -> StepFill | None:
    """Where the new step's inputs take a token still on the device: each scheduled seq whose
    last input is its placeholder reads the previous step's sampled row."""
    if prev.launched.result is None:
        return None
    src = {id(seq): r for r, (seq, k) in enumerate(prev.placeholders) if k >= 0}
    index: list[int] = []
    source: list[int] = []
    flat = 0
    for seq, n in zip(sched.seqs, sched.num_tokens):
        flat += n
        r = src.get(id(seq))
        if r is not None and seq.num_computed_tokens + n == prev.placeholders[r][1] + 1 \
                + seq.num_prompt_tokens:
            index.append(flat - 1)
            source.append(r)
    if not index:
        return None
    return StepFill(index, source, prev.launched.result.sampled_token_ids)
