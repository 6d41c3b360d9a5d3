"""The sampler's inputs for one scheduled step: which batch rows are sampled (n > 1 parents
repeat on their first token), which sample each row draws for (the seeded draw's key), grammar
matchers and custom logits processors. `core` is the `EngineCore` (engine/core/engine_core.py)
that owns the requests."""

from __future__ import annotations

from typing import Any

from kvserve.engine.core.scheduler import SchedulerOutput
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.random_draw import check_seed
from kvserve.engine.sample.sampler import SamplingMetadata
from kvserve.engine.structured_output.grammar import GrammarState


def sampling_rows(core: Any, sched: SchedulerOutput, with_metadata: bool = True
                  ) -> tuple[list[int], SamplingMetadata | None]:
    """Batch indices whose logits are sampled (prefill complete); n > 1 parents repeat. A
    request whose seed or grammar cannot be used fails alone (`core.fail_request`).
    `with_metadata=False`: the rows only (speculative decoding builds its own metadata)."""
    rows: list[int] = []
    seqs: list[Sequence] = []
    drafts = sched.spec_token_ids or [[] for _ in sched.seqs]
    for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_tokens)):
        if seq.num_computed_tokens + n - len(drafts[i]) == seq.num_tokens:
            for _ in range(1 + (seq.pending_forks if not seq.output_token_ids else 0)):
                rows.append(i)
                seqs.append(seq)
    for r, seq in enumerate(seqs):
        try:
            check_seed(seq.params.seed)
            grammar_state(core, seq)
        except Exception as exc:  # noqa: BLE001 - handed to that request's caller
            core.fail_request(seq.request_id, exc)
    if core.failed_now:
        kept = [(i, s) for i, s in zip(rows, seqs) if s.request_id not in core.failed_now]
        rows, seqs = [i for i, _ in kept], [s for _, s in kept]
    if not rows or not with_metadata:
        return rows, None
    return rows, _metadata(core, seqs)


def _metadata(core: Any, seqs: list[Sequence]) -> SamplingMetadata:
    indices = {r: i for r, i in enumerate(sample_indices(core, seqs)) if i}
    meta = SamplingMetadata.build(
        # an embeddings prompt's placeholder ids are no tokens: penalties see only its output
        [s.params for s in seqs], [s.prompt_token_ids if s.prompt_embeds is None else []
                                   for s in seqs],
        [s.output_token_ids for s in seqs], indices, core.vocab_size, core.device,
        eos_token_id=core.eos_token_ids)
    if any(core.requests[s.request_id].grammar is not None for s in seqs):
        meta.token_bitmask = core.grammars.token_bitmask([grammar_state(core, s) for s in seqs])
    return meta


def grammar_state(core: Any, seq: Sequence) -> GrammarState | None:
    """The seq's matcher (made on first use: a forked sibling gets its own), in step with its
    output tokens; None for an unconstrained request."""
    state = core.requests[seq.request_id]
    if state.grammar is None:
        return None
    matcher = state.matchers.get(seq.index)
    if matcher is None:
        matcher = state.matchers[seq.index] = core.grammars.matcher(state.grammar)
    matcher.sync(seq.output_token_ids)
    return matcher


def sample_indices(core: Any, seqs: list[Sequence]) -> list[int]:
    """Which of its request's samples each row draws for: the seq's own index, an n > 1
    parent's repeats those its siblings get once forked (engine/core/step_update.py), all
    shifted by the request's first index (a continuation's choice). A seeded row's draw is
    keyed by it (engine/sample/random_draw.py)."""
    out: list[int] = []
    repeats: dict[int, int] = {}  # seq_id -> rows of it so far (a parent's repeats follow it)
    for seq in seqs:
        state = core.requests[seq.request_id]
        repeat = repeats[seq.seq_id] = repeats.get(seq.seq_id, -1) + 1
        index = seq.index if repeat == 0 else len(state.seqs) + repeat - 1
        out.append(state.first_index + index)
    return out


def logits_hook(procs: Any, sched: SchedulerOutput, rows: list[int]) -> Any:
    """Custom logits processors over this step's rows (a row's key: its seq, fork number)."""
    seqs = [sched.seqs[i] for i in rows]
    keys = [(s.seq_id, rows[:r].count(i)) for r, (i, s) in enumerate(zip(rows, seqs))]
    return lambda logits: procs.apply(logits, keys, seqs)
