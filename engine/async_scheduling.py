"""Async scheduling (vLLM's `--async-scheduling`): schedule and launch step N+1 before reading
step N's sampled tokens, so the host's scheduling, input preparation and kernel launches run while
the device still computes step N.

How a step is split (`OverlappedStep` drives `LLMEngine`'s pieces):
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
would need the sampled ids). On a CPU the forward runs inside the launch, so nothing overlaps:
the mode is on by default only on a GPU (`async_scheduling=None`), and the tests force it on a
CPU to check that it yields exactly the synchronous tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.prompt_logprobs import append_entries
from kvserve.engine.sample.prompt_logprobs import plan as plan_prompt_logprobs

if TYPE_CHECKING:  # LLMEngine and its RequestState are `Any` here: llm_engine imports this
    from kvserve.engine.outputs import RequestOutput
    from kvserve.engine.sample.sampler import SamplerOutput

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
    rows: list[int]  # batch index of each sampled row
    result: SamplerOutput | None
    prompt_plan: Any
    prompt_result: Any
    t0: float
    # each sampled row's seq and the index of its placeholder in the seq's output_token_ids
    placeholders: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def overlappable(self) -> bool:
        """Whether the next step may launch before this one's tokens are read: no prompt
        logprobs to append, no n > 1 parent that forks on this step's tokens."""
        return self.prompt_plan is None and len(set(self.rows)) == len(self.rows)


def enabled(asked: bool | None, engine: Any) -> bool:
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
    return (state.grammar is None and p.n == 1 and state.best_of is None
            and p.prompt_logprobs is None and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0)


class OverlappedStep:
    """`LLMEngine.step`: launch, then finish; with async scheduling (`overlap`) the next step is
    launched before the current one finishes, so at most one step is in flight between calls."""

    def __init__(self, engine: Any, overlap: bool) -> None:  # an LLMEngine
        self.engine = engine
        self.overlap = overlap  # False: every step is launched and finished in one call
        self.inflight: InFlight | None = None
        self.overlapped_steps = 0  # steps launched while the previous one was in flight

    def step(self) -> list[RequestOutput]:
        e = self.engine
        outputs, e._aborted = e._aborted, []
        e._failed_now = set()
        self._drop_if_dead()  # its requests were aborted since the last call
        if self.inflight is None:
            self.inflight = self._launch(lookahead=None)
            if self.inflight is None:
                return outputs
        current, self.inflight = self.inflight, None
        if current.overlappable and self._may_overlap():
            self.inflight = self._launch(lookahead=current)
            if self.inflight is not None:
                self.overlapped_steps += 1
        outputs += self._finish(current)
        self._drop_if_dead()  # every seq in it ended meanwhile: nothing to wait for
        e.abort_request(list(e._failed_now))
        return outputs

    def _drop_if_dead(self) -> None:
        """Finish and forget a step in flight whose seqs have all ended (it yields nothing; its
        time is not a step's, so the swap cost model does not see it)."""
        if self.inflight is not None and all(s.is_finished for s in self.inflight.sched.seqs):
            self._finish(self.inflight, observe=False)
            self.inflight = None

    def drain(self) -> None:
        """Finish the step in flight (before anything that changes the scheduler's or the
        adapters' state outside a step); its outputs come with the next `step()`."""
        if self.inflight is None:
            return
        current, self.inflight = self.inflight, None
        self.engine._aborted += self._finish(current)

    def _may_overlap(self) -> bool:
        e = self.engine
        return self.overlap and e.logits_processors is None and all(
            request_overlaps(s) for s in e.requests.values())

    def _launch(self, lookahead: InFlight | None) -> InFlight | None:
        """Schedule and launch one step. With `lookahead` (the step in flight) nothing is
        preempted, the seqs it surely finishes sit out, and its placeholders become device
        fills."""
        e = self.engine
        t0 = time.perf_counter()
        skip = _sure_to_finish(lookahead, e.max_model_len) if lookahead is not None else None
        sched = e.scheduler.schedule(lookahead_skip=skip)
        if sched.is_empty:
            e.runner.move_blocks(sched)  # a swap-in may precede the seq's next forward
            e._observe_copies()
            return None
        rows, sampling = e._sampling_rows(sched)
        if e.logits_processors is not None:
            e.runner.logits_hook = e._logits_hook(sched, rows)
        prompt_plan = plan_prompt_logprobs(sched.seqs, sched.num_tokens)
        fill = _fill(sched, lookahead) if lookahead is not None else None
        result, prompt_result = e.runner.execute(sched, e.kv, rows, sampling, prompt_plan,
                                                 e._lora_slots(sched), fill=fill)
        if prompt_result is not None:  # before the seqs move on: the plan read their progress
            append_entries(prompt_plan, prompt_result, e.tokenizer)  # type: ignore[arg-type]
        for seq, n in zip(sched.seqs, sched.num_tokens):
            seq.num_computed_tokens += n
        placeholders: list[tuple[Sequence, int]] = []
        if result is not None:
            for r, i in enumerate(rows):
                seq = sched.seqs[i]
                if r > 0 and rows[r - 1] == i:  # an n > 1 fork's row: it appends on finish
                    placeholders.append((seq, -1))
                    continue
                seq.output_token_ids.append(PLACEHOLDER)
                placeholders.append((seq, len(seq.output_token_ids) - 1))
        return InFlight(sched, rows, result, prompt_plan if prompt_result is not None else None,
                        prompt_result, t0, placeholders)

    def _finish(self, step: InFlight, observe: bool = True) -> list[RequestOutput]:
        """Read the step's tokens and apply them (see the module doc)."""
        e = self.engine
        result = step.result
        tokens = result.sampled_token_ids.tolist() if result is not None else []
        now = time.monotonic()
        live = [not s.is_finished and s.request_id in e.requests for s, _ in step.placeholders]
        for (seq, k), tok, ok in zip(step.placeholders, tokens, live):
            if ok and k >= 0:
                seq.output_token_ids[k] = tok
        for seq in step.sched.seqs:  # every computed token is known now: cache the full blocks
            if not seq.is_finished and seq.request_id in e.requests:
                e.kv.register_computed(seq)
        touched: list[Any] = []
        if result is not None:
            # Each token is applied as the sync engine appends it: the seq's outputs end just
            # before it (a later step's placeholder comes back after, unless the seq finished).
            after: list[list[int] | None] = []
            for (seq, k), ok in zip(step.placeholders, live):
                after.append(seq.output_token_ids[k + 1:] if ok and k >= 0 else None)
                if ok and k >= 0:
                    del seq.output_token_ids[k:]
            touched = e._apply_samples(step.sched, step.rows, result, now, tokens, after)
        if observe:
            e._observe_step(step.sched, time.perf_counter() - step.t0)
        touched = [s for s in touched if s.request_id not in e._failed_now]
        outputs = [e._make_output(s) for s in touched]
        for s in touched:
            if s.finished:
                e.requests.pop(s.request_id, None)
        return outputs


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
    if prev.result is None:
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
    return StepFill(index, source, prev.result.sampled_token_ids)
