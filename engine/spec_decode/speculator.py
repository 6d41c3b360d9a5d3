"""The engine core's speculative decoding (one per EngineCore with a speculative_config):
before a step it asks the proposer for drafts of the decoding requests; the scheduler reserves
their slots; the model runner scores the last token and the drafts in one forward (as a small
prefill chunk) and the sampler draws the target's token at every scored position; after the
step the longest agreeing prefix is kept (rejection_sampler.py), the rejected drafts' KV slots
are rolled back (num_computed_tokens lowered, blocks that hold no kept token freed).

Structured outputs (engine/structured_output/): a request under a grammar gets its drafts cut
at the first token the grammar refuses (the matcher is taken over them and rolled back), each
scored position is masked by the grammar as it stands after the drafts before it (one bitmask
for all rows, filled depth by depth), so the target's sample there, and with it the rejection
test, uses the masked target distribution; the matcher then moves over exactly the kept tokens
(the accepted drafts and the target's own). Beam searches and engines with custom logits
processors get no drafts (they decode as without speculation).

Async scheduling (engine/async_scheduling.py) runs with the host-side proposers (ngram, suffix):
a verification step is finished before the next one is scheduled (the next positions follow its
accepted count, the next drafts its tokens); a step without drafts lets the next one launch
ahead when `would_draft`, the proposer asked over the tokens known while the step is in flight,
drafts for nobody (the lookahead step then drafts nothing), else the next step runs in turn with
drafts over every token. A draft model or an EAGLE head runs every step in turn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.engine.core.sampling_inputs import grammar_state, sample_indices
from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.core.step_update import append_token, apply_samples
from kvserve.engine.sample.sampler import SamplerOutput, SamplingMetadata
from kvserve.engine.spec_decode.adaptive import AdaptiveDrafts
from kvserve.engine.spec_decode.config import HOST_METHODS, SpeculativeConfig
from kvserve.engine.spec_decode.metrics import SpecCounters, SpecLogger
from kvserve.engine.spec_decode.proposer import (Proposer, ProposerContext, SpecRequestView,
                                                 StepHiddenStates)
from kvserve.engine.spec_decode.registry import make_proposer
from kvserve.engine.spec_decode.rejection_sampler import num_accepted


def stream_id(seq: Sequence) -> str:
    """The proposer's key of a token stream: the request id, "#i" for sample i > 0."""
    return seq.request_id if seq.index == 0 else f"{seq.request_id}#{seq.index}"


@dataclass
class SpecGroup:
    """A scored run: batch index, its first sampler row, the drafts (rows: len(drafts) + 1)."""

    batch_index: int
    first_row: int
    drafts: list[int]
    accepted: int = 0  # set once verified
    valid: int | None = None  # drafts the request's grammar allows (None: all); never more kept


@dataclass
class SpecPlan:
    """A step's verification: the groups and each sampler row's offset back from its seq's
    last scheduled token (0: the last)."""

    groups: list[SpecGroup] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    def rows_of_groups(self) -> set[int]:
        return {g.first_row + j for g in self.groups for j in range(len(g.drafts) + 1)}


class Speculator:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext,
                 proposer: Proposer | None = None) -> None:
        self.config = config
        self.proposer = proposer or make_proposer(config, context)
        self.max_tokens = int(config.num_speculative_tokens)  # type: ignore[arg-type]
        self.adaptive = AdaptiveDrafts(self.max_tokens, config.adaptive)
        self.counters = SpecCounters()
        self.log = SpecLogger()
        self.live: set[str] = set()  # streams proposed for and not yet released

    # ---- before the step ----------------------------------------------------------------------
    def propose(self, core: Any) -> None:
        """Set `spec_token_ids` on the running decoding seqs (cleared on every other one)."""
        running = core.scheduler.running
        for seq in running:
            seq.spec_token_ids = []
        self._release_gone(running)
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit \
                or not self.adaptive.drafts_allowed(len(running), _draining(core)):
            return
        threshold = self.adaptive.threshold()
        chosen: list[tuple[Sequence, int]] = []
        for seq in running:
            k = self._budget(core, seq, threshold)
            if k > 0:
                chosen.append((seq, k))
        if not chosen or not self.adaptive.step_pays([(stream_id(s), k) for s, k in chosen]):
            return
        views = [SpecRequestView(stream_id(s), np.asarray(s.all_token_ids, dtype=np.int64),
                                 s.num_prompt_tokens) for s, _ in chosen]
        drafts = self.proposer.propose(views, max(k for _, k in chosen))
        for (seq, k), d in zip(chosen, drafts):
            seq.spec_token_ids = _grammar_prefix(core, seq, [int(t) for t in d[:k]])
            self.live.add(stream_id(seq))

    def _budget(self, core: Any, seq: Sequence, threshold: float,
                look_ahead: bool = False) -> int:
        """Drafts a seq may get: 0 unless it decodes without a beam; at most what max_tokens
        and max_model_len leave after the token it samples anyway."""
        if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.output_token_ids \
                or seq.pending_forks or seq.group is not None:
            return 0
        if seq.request_id not in core.requests or core.logits_processors is not None:
            return 0
        left = _tokens_left(core, seq) - 1
        if left <= 0:
            return 0
        return min(left, self.adaptive.num_tokens(stream_id(seq), threshold, look_ahead))

    def _release_gone(self, running: list[Sequence]) -> None:
        """Tell the proposer of the streams no longer running (finished, aborted, preempted)."""
        now = {stream_id(s) for s in running}
        for sid in self.live - now:
            self.proposer.release(sid)
            self.adaptive.release(sid)
        self.live &= now

    # ---- async scheduling (engine/async_scheduling.py) ----------------------------------------
    @property
    def overlaps(self) -> bool:
        """Whether steps may launch ahead at all: only with a proposer that drafts on the host
        from the token ids (ngram, suffix); a draft model or an EAGLE head reads each step's
        forward (its KV, its hidden states), so those engines run every step in turn."""
        return self.config.method in HOST_METHODS and not self.proposer.uses_hidden_states

    def would_draft(self, core: Any) -> bool:
        """Whether the next step would draft for some running seq, asked of the proposer over
        the tokens known now (a seq whose token is in flight: without it). Called while a
        step without drafts is in flight (its forward runs meanwhile): False lets the next
        step launch ahead, drafting nothing; True runs it in turn, with full-context drafts."""
        running = core.scheduler.running
        self._release_gone(running)  # steps that keep launching ahead never call `propose`
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit \
                or not self.adaptive.drafts_allowed(len(running), _draining(core)):
            return False
        threshold = self.adaptive.threshold()
        chosen: list[tuple[Sequence, int]] = []
        for seq in running:
            k = self._budget(core, seq, threshold, look_ahead=True)
            if k > 0:
                chosen.append((seq, k))
        if not chosen or not self.adaptive.step_pays([(stream_id(s), k) for s, k in chosen]):
            return False
        views = [SpecRequestView(stream_id(s), _known_tokens(s), s.num_prompt_tokens)
                 for s, _ in chosen]
        self.live.update(v.request_id for v in views)  # the proposer may keep state for them
        drafts = self.proposer.propose(views, max(k for _, k in chosen))
        return any(len(d) > 0 for d in drafts)

    @staticmethod
    def take_drafts(sched: SchedulerOutput) -> None:
        """The drafts the scheduler made room for (its token budget may have cut some), per
        batch index, into `sched.spec_token_ids`; the seqs' own lists are cleared."""
        out: list[list[int]] = []
        for seq, n in zip(sched.seqs, sched.num_tokens):
            extra = n - (seq.num_tokens - seq.num_computed_tokens)
            out.append(seq.spec_token_ids[:extra] if extra > 0 else [])
            seq.spec_token_ids = []
        sched.spec_token_ids = out if any(out) else []

    # ---- the sampler's rows -------------------------------------------------------------------
    @staticmethod
    def expand_rows(core: Any, sched: SchedulerOutput, rows: list[int]
                    ) -> tuple[list[int], SamplingMetadata | None, SpecPlan]:
        """`rows` (sampling_inputs.sampling_rows) with one row per scored position of each
        drafted seq; row j of a seq samples as if its output held the first j drafts already
        (penalties, min_tokens, the seeded draw's position)."""
        plan = SpecPlan()
        base = [sched.seqs[i] for i in rows]
        indices = sample_indices(core, base) if rows else []
        out_rows: list[int] = []
        seqs: list[Sequence] = []
        outputs: list[list[int]] = []
        draws: list[int] = []
        prefixes: list[list[int]] = []  # the drafts before each row (its grammar's position)
        for r, i in enumerate(rows):
            seq, drafts = sched.seqs[i], sched.spec_token_ids[i]
            forked = r > 0 and rows[r - 1] == i
            scored = drafts if drafts and not forked else []
            if scored:
                plan.groups.append(SpecGroup(i, len(out_rows), scored))
            for j in range(len(scored) + 1):
                out_rows.append(i)
                plan.offsets.append(len(scored) - j)
                seqs.append(seq)
                outputs.append(seq.output_token_ids + scored[:j] if j else seq.output_token_ids)
                draws.append(indices[r])
                prefixes.append(scored[:j])
        if not out_rows:
            return out_rows, None, plan
        meta = SamplingMetadata.build(
            [s.params for s in seqs],
            [s.prompt_token_ids if s.prompt_embeds is None else [] for s in seqs], outputs,
            {r: d for r, d in enumerate(draws) if d}, core.vocab_size, core.device,
            eos_token_id=core.eos_token_ids)
        if any(core.requests[s.request_id].grammar is not None for s in seqs):
            # each scored position masked by its grammar after the drafts before it
            meta.token_bitmask, reached = core.grammars.draft_token_bitmask(
                [grammar_state(core, s) for s in seqs], prefixes)
            for g in plan.groups:
                g.valid = reached[g.first_row + len(g.drafts)]
        return out_rows, meta, plan

    # ---- after the step -----------------------------------------------------------------------
    def apply(self, core: Any, sched: SchedulerOutput, step: Any, tokens: list[int],
              now: float) -> list[Any]:
        """Apply a verification step's tokens: the plain rows as usual, each drafted seq its
        accepted drafts and the target's next token; roll back the rejected slots."""
        plan: SpecPlan = step.spec
        result: SamplerOutput = step.result
        in_groups = plan.rows_of_groups()
        plain = [r for r in range(len(step.rows)) if r not in in_groups]
        touched: dict[str, Any] = {}
        if plain:
            sub = _select(result, plain)
            for s in apply_samples(core, sched, [step.rows[r] for r in plain], sub, now,
                                   [tokens[r] for r in plain], [None] * len(plain)):
                touched[s.request_id] = s
        if not plan.groups:
            return list(touched.values())
        accepted = self._accepted(plan, tokens)
        lps = result.logprobs.tolist() if result.logprobs is not None else None
        lp_ids = result.logprob_token_ids.tolist() \
            if result.logprob_token_ids is not None else None
        ranks = result.sampled_token_ranks.tolist() \
            if result.sampled_token_ranks is not None else None
        for g, a in zip(plan.groups, accepted):
            seq, g.accepted = sched.seqs[g.batch_index], a
            self.counters.record(len(g.drafts), a)
            self.adaptive.observe(stream_id(seq), len(g.drafts), a)
            if seq.is_finished or seq.request_id not in core.requests:
                continue
            state = core.requests[seq.request_id]
            try:
                for r in range(g.first_row, g.first_row + a + 1):
                    append_token(core, state, seq, tokens[r], now,
                                 (lps[r], lp_ids[r]) if lps and lp_ids else None,
                                 ranks[r] if ranks else None)
                    if seq.is_finished:
                        break
            except Exception as exc:  # noqa: BLE001 - handed to that request's caller
                core.fail_request(seq.request_id, exc)
            if not seq.is_finished:
                seq.num_computed_tokens -= len(g.drafts) - a
                core.kv.trim(seq, seq.num_computed_tokens)
                core.kv.register_computed(seq)
            touched[state.request_id] = state
        return list(touched.values())

    @staticmethod
    def _accepted(plan: SpecPlan, tokens: list[int]) -> list[int]:
        """Accepted drafts per group, in one vectorised comparison."""
        k = max(len(g.drafts) for g in plan.groups)
        drafts = torch.full((len(plan.groups), k), -1, dtype=torch.int64)
        sampled = torch.full((len(plan.groups), k + 1), -2, dtype=torch.int64)
        flat = torch.tensor(tokens, dtype=torch.int64)
        for row, g in enumerate(plan.groups):
            n = len(g.drafts)
            # drafts past the grammar's first refusal stay -1: never accepted
            drafts[row, : g.valid if g.valid is not None else n] = \
                torch.tensor(g.drafts[: g.valid])
            sampled[row, : n + 1] = flat[g.first_row : g.first_row + n + 1]
        return num_accepted(drafts, sampled).tolist()

    def observe_step(self, core: Any, sched: SchedulerOutput, num_output_tokens: int,
                     seconds: float) -> None:
        """A finished step's size and time (the adaptive draft lengths' cost model), and in an
        offline batch's tail the largest budget left (adaptive.py's module doc)."""
        drafts = sum(len(d) for d in sched.spec_token_ids)
        decoding = sched.total_tokens == len(sched.seqs) + drafts
        critical = _largest_budget_left(core) if _draining(core) else None
        self.adaptive.observe_step(sched.total_tokens, num_output_tokens, seconds, decoding,
                                   drafts > 0, len(sched.seqs), critical,
                                   1 + max(map(len, sched.spec_token_ids), default=0))
        self.log.maybe_log(self.counters)

    def hidden_states(self, core: Any, sched: SchedulerOutput, step: Any) -> None:
        """Hand the step's hidden states to a proposer fed by them (EAGLE): every scheduled
        seq's rows, of which the kept ones (a chunk: all; a verification: the last token and
        the accepted drafts)."""
        hidden = getattr(core.runner, "last_hidden", None)
        if hidden is None or not self.proposer.uses_hidden_states:
            return
        core.runner.last_hidden = None
        accepted = {g.batch_index: g.accepted for g in (step.spec.groups if step.spec else [])}
        qsl, kept, ids = [0], [], []
        for i, (seq, n, start) in enumerate(zip(sched.seqs, sched.num_tokens, step.starts)):
            qsl.append(qsl[-1] + n)
            keep = n if i not in accepted else n - len(sched.spec_token_ids[i]) + accepted[i]
            kept.append(keep)
            ids.append(seq.token_range(start, start + keep))
        self.proposer.on_step(StepHiddenStates(
            [stream_id(s) for s in sched.seqs], hidden, qsl, kept, ids, list(step.starts),
            [start + n >= s.num_prompt_tokens
             for s, n, start in zip(sched.seqs, kept, step.starts)]))


def _draining(core: Any) -> bool:
    """An offline batch's tail: `LLM.generate` drains its own requests (no more can come) and
    none waits or is swapped out, so a slot a request leaves stays empty."""
    sched = core.scheduler
    return core.arrivals_closed and not sched.waiting and not sched.swapped


def _tokens_left(core: Any, seq: Sequence) -> int:
    """The tokens `seq` may still generate (max_tokens and max_model_len)."""
    return min(seq.params.max_tokens - len(seq.output_token_ids),  # type: ignore[operator]
               core.max_model_len - seq.num_tokens)


def _largest_budget_left(core: Any) -> int:
    """The most tokens a running seq may still generate."""
    return max((_tokens_left(core, s) for s in core.scheduler.running if not s.is_finished),
               default=0)


def _known_tokens(seq: Sequence) -> np.ndarray:
    """A seq's prompt and output without the placeholders of tokens still in flight
    (async_scheduling.PLACEHOLDER: negative, never a vocabulary id)."""
    ids = seq.all_token_ids
    n = len(ids)
    while n > seq.num_prompt_tokens and ids[n - 1] < 0:
        n -= 1
    return np.asarray(ids[:n], dtype=np.int64)


def _grammar_prefix(core: Any, seq: Sequence, drafts: list[int]) -> list[int]:
    """`drafts` cut at the first token the request's grammar refuses (none: as they are)."""
    if not drafts or core.requests[seq.request_id].grammar is None:
        return drafts
    try:
        state = grammar_state(core, seq)
    except Exception:  # noqa: BLE001 - the step's sampling_rows fails the request, by name
        return []
    return drafts if state is None else drafts[: state.num_valid(drafts)]


def _select(result: SamplerOutput, rows: list[int]) -> SamplerOutput:
    """The sampler output of `rows` only."""
    index = torch.tensor(rows, dtype=torch.int64, device=result.sampled_token_ids.device)
    pick = (lambda t: None if t is None else t.index_select(0, index.to(t.device)))
    return SamplerOutput(pick(result.sampled_token_ids), pick(result.logprobs),
                         pick(result.logprob_token_ids), pick(result.sampled_token_ranks))


def make_speculator(core: Any) -> Speculator | None:
    """The engine's Speculator (None without a speculative_config)."""
    config = core.config.speculative_config
    if config is None:
        return None
    context = ProposerContext(core.vocab_size, core.max_model_len, core.device, core.dtype,
                              core.hf_config, core.runner.model, str(core.model_path))
    spec = Speculator(config, context)
    core.runner.keep_hidden = spec.proposer.uses_hidden_states
    return spec


