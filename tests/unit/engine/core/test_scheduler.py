"""Scheduler over a real KVCacheManager with synthetic sequences and no model: a step advances
`num_computed_tokens` and appends a token the way LLMEngine.step does, and a simulated KV memory
checks that every sequence always reads back its own tokens."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.sample.sampling_params import SamplingParams


def next_token(seq: Sequence) -> int:
    """A deterministic 'model': the same sequence gets the same tokens, recomputed or not."""
    return (seq.seq_id * 31 + seq.num_tokens * 7) % 97


class Sim:
    """The engine's step loop without a model (see LLMEngine.step / ModelRunner._move_blocks)."""

    def __init__(self, num_blocks: int, block_size: int = 4, max_num_seqs: int = 8,
                 max_num_batched_tokens: int = 64, mode: str = "recompute",
                 num_cpu_blocks: int = 0, caching: bool = True, chunked: bool = True) -> None:
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching, num_cpu_blocks)
        self.config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, 1024, chunked, mode)
        self.sched = Scheduler(self.config, self.kv)
        self.dev: dict[int, int] = {}  # device slot -> token whose K/V it holds
        self.cpu: dict[int, int] = {}
        self.seqs: list[Sequence] = []
        self.finished: list[Sequence] = []
        self.outputs: list[SchedulerOutput] = []
        self.computed = 0  # tokens run through the "model"
        self.next_id = 0

    def add(self, prompt: list[int], max_tokens: int = 4, n: int = 1, salt: str | None = None
            ) -> Sequence:
        self.next_id += 1
        seq = Sequence(self.next_id, f"req-{self.next_id}", 0, list(prompt),
                       SamplingParams(max_tokens=max_tokens, n=n), cache_salt=salt)
        seq.pending_forks = n - 1
        self.seqs.append(seq)
        self.sched.add(seq)
        return seq

    def _move(self, out: SchedulerOutput) -> None:
        bs = self.bs
        for d, c in out.blocks_to_swap_out:
            for o in range(bs):
                if d * bs + o in self.dev:
                    self.cpu[c * bs + o] = self.dev[d * bs + o]
        for c, d in out.blocks_to_swap_in:
            for o in range(bs):
                if c * bs + o in self.cpu:
                    self.dev[d * bs + o] = self.cpu[c * bs + o]
        for s, d in out.blocks_to_copy:
            for o in range(bs):
                if s * bs + o in self.dev:
                    self.dev[d * bs + o] = self.dev[s * bs + o]

    def read(self, seq: Sequence) -> list[int | None]:
        table = self.kv.block_ids(seq)
        return [self.dev.get(table[p // self.bs] * self.bs + p % self.bs)
                for p in range(seq.num_computed_tokens)]

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.outputs.append(out)
        self._move(out)  # LLMEngine.step moves blocks even when no seq runs (a swap-out, say)
        if out.is_empty:
            return out
        for seq, n in zip(out.seqs, out.num_tokens):
            assert self.read(seq) == seq.all_token_ids[: seq.num_computed_tokens]
            table, toks, start = self.kv.block_ids(seq), seq.all_token_ids, seq.num_computed_tokens
            for p in range(start, start + n):
                self.dev[table[p // self.bs] * self.bs + p % self.bs] = toks[p]
            seq.num_computed_tokens += n
            self.computed += n
            self.kv.register_computed(seq)
        for seq, n in zip(out.seqs, out.num_tokens):
            if seq.num_computed_tokens == seq.num_tokens:
                for _ in range(seq.pending_forks if not seq.output_token_ids else 0):
                    self._fork(seq)
                self._append(seq)
        return out

    def _fork(self, parent: Sequence) -> None:
        parent.pending_forks -= 1
        self.next_id += 1
        child = Sequence(self.next_id, parent.request_id, 1, parent.prompt_token_ids,
                         parent.params, cache_salt=parent.cache_salt)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.sched.add_running(child)
        self.seqs.append(child)
        self._append(child)

    def _append(self, seq: Sequence) -> None:
        seq.output_token_ids.append(next_token(seq))
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            self.sched.finish(seq)
            self.finished.append(seq)

    def run(self, max_steps: int = 2000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps, "the scheduler stopped making progress"
        return steps


def prompt(n: int, start: int = 0) -> list[int]:
    return [(start + i) % 89 + 1 for i in range(n)]


# ---- batching limits --------------------------------------------------------------------------

def test_max_num_seqs_bounds_every_batch_and_every_request_finishes():
    sim = Sim(num_blocks=64, max_num_seqs=3)
    for i in range(10):
        sim.add(prompt(5, 10 * i), max_tokens=3)
    sim.run()
    assert max(len(o.seqs) for o in sim.outputs) == 3
    assert len(sim.finished) == 10
    assert all(len(s.output_token_ids) == 3 for s in sim.finished)
    assert sim.kv.num_free_blocks == 64


def test_max_num_seqs_counts_the_forks_a_request_will_make():
    sim = Sim(num_blocks=64, max_num_seqs=4)
    sim.add(prompt(6), max_tokens=3, n=3)
    sim.add(prompt(6, 20), max_tokens=3, n=3)
    sim.add(prompt(6, 40), max_tokens=3)
    sim.run()
    assert max(len(o.seqs) for o in sim.outputs) <= 4
    assert len(sim.finished) == 7


def test_max_num_batched_tokens_bounds_every_step():
    sim = Sim(num_blocks=128, max_num_seqs=8, max_num_batched_tokens=20)
    for i in range(6):
        sim.add(prompt(13, 7 * i), max_tokens=4)
    sim.run()
    assert max(o.total_tokens for o in sim.outputs) == 20
    assert len(sim.finished) == 6


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    seq = sim.add(prompt(50), max_tokens=2)
    chunks = []
    while not seq.output_token_ids:
        out = sim.step()
        chunks.append(out.num_tokens[out.seqs.index(seq)])
    assert chunks == [16, 16, 16, 2]
    assert len(sim.kv.block_ids(seq)) == 13  # 50 tokens in blocks of 4: allocated chunk by chunk


def test_a_long_prefill_shares_the_budget_with_running_decodes():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16)
    short = sim.add(prompt(3), max_tokens=10)
    sim.step()
    long = sim.add(prompt(40, 50), max_tokens=2)
    out = sim.step()
    assert out.seqs == [short, long] and out.num_tokens == [1, 15]


def test_without_chunking_a_prompt_over_the_budget_waits_for_a_step_of_its_own():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16, chunked=False)
    a = sim.add(prompt(10), max_tokens=3)
    b = sim.add(prompt(10, 30), max_tokens=3)
    c = sim.add(prompt(2, 60), max_tokens=3)
    out = sim.step()
    assert out.seqs == [a]  # b does not fit in the 6 tokens left; c must not overtake it
    out = sim.step()
    assert out.seqs == [a, b, c] and out.num_tokens == [1, 10, 2]
    sim.run()
    assert {s.seq_id for s in sim.finished} == {a.seq_id, b.seq_id, c.seq_id}


# ---- FCFS ---------------------------------------------------------------------------------------

def test_admission_is_first_come_first_served():
    sim = Sim(num_blocks=64, max_num_seqs=2)
    seqs = [sim.add(prompt(4 + (i % 3), 9 * i), max_tokens=2 + i % 2) for i in range(7)]
    admitted: list[Sequence] = []
    while sim.sched.has_unfinished():
        out = sim.step()
        admitted += [s for s in out.seqs if s not in admitted]
    assert admitted == seqs


def test_a_waiting_request_that_does_not_fit_blocks_later_ones():
    sim = Sim(num_blocks=6, max_num_seqs=4, chunked=False)
    a = sim.add(prompt(16), max_tokens=6)  # 4 blocks, growing to 6
    b = sim.add(prompt(12, 20), max_tokens=2)  # 3 blocks, 2 are free: does not fit
    c = sim.add(prompt(2, 40), max_tokens=2)  # would fit, but arrived after b
    out = sim.step()
    assert out.seqs == [a]
    assert list(sim.sched.waiting) == [b, c]
    sim.run()
    order = [s.seq_id for s in sim.finished]
    assert sorted(order) == [a.seq_id, b.seq_id, c.seq_id]


# ---- preemption -------------------------------------------------------------------------------

def _pressure(mode: str, num_cpu_blocks: int = 0) -> tuple[Sim, list[Sequence]]:
    """Three requests whose decodes outgrow a 10-block pool."""
    sim = Sim(num_blocks=10, max_num_seqs=4, mode=mode, num_cpu_blocks=num_cpu_blocks)
    seqs = [sim.add(prompt(7, 30 * i), max_tokens=9) for i in range(3)]
    return sim, seqs


def _reference_outputs() -> list[list[int]]:
    sim = Sim(num_blocks=64, max_num_seqs=4)
    seqs = [sim.add(prompt(7, 30 * i), max_tokens=9) for i in range(3)]
    sim.run()
    assert sim.sched.num_preemptions == 0
    return [s.output_token_ids for s in seqs]


def test_recompute_preempts_the_newest_and_frees_its_blocks():
    sim, (a, b, c) = _pressure("recompute")
    while sim.sched.num_preemptions == 0:
        out = sim.step()
    assert out.num_preempted == 1 and c.num_preemptions == 1
    assert c.status == SequenceStatus.WAITING and sim.sched.waiting[0] is c
    assert c.num_computed_tokens == 0 and sim.kv.block_ids(c) == []
    assert out.seqs == [a, b] and c not in sim.sched.running
    assert out.blocks_to_swap_out == []
    sim.run()
    assert [s.output_token_ids for s in (a, b, c)] == _reference_outputs()
    assert sim.kv.num_free_blocks == 10
    # c's prompt and its early outputs were computed twice (minus what the prefix cache kept).
    assert sim.computed > sum(s.num_tokens - 1 for s in (a, b, c))


def test_a_preempted_request_goes_back_ahead_of_later_arrivals():
    sim, (a, b, c) = _pressure("recompute")
    sim.step()
    d = sim.add(prompt(30, 50), max_tokens=2)  # arrives later; waits (no room)
    while sim.sched.num_preemptions == 0:
        sim.step()
    assert list(sim.sched.waiting) == [c, d]
    sim.run()
    assert sim.finished.index(c) < sim.finished.index(d)


def test_recompute_resumes_from_prompt_plus_generated_tokens():
    sim, (a, b, c) = _pressure("recompute")
    while sim.sched.num_preemptions == 0:
        sim.step()
    generated = list(c.output_token_ids)
    assert generated  # it had produced tokens before being preempted
    while c.status != SequenceStatus.RUNNING:
        out = sim.step()
    i = out.seqs.index(c)
    # Re-admitted with everything it had (prompt + outputs) to compute; its own full blocks were
    # still in the prefix cache, so only the rest ran again.
    assert c.num_computed_tokens == 7 + len(generated)
    assert 0 < out.num_tokens[i] < c.num_computed_tokens
    assert (c.num_computed_tokens - out.num_tokens[i]) % 4 == 0  # skipped whole cached blocks
    assert c.output_token_ids[: len(generated)] == generated
    assert len(c.output_token_ids) == len(generated) + 1


def test_swap_preemption_keeps_the_computed_tokens_and_resumes():
    sim, (a, b, c) = _pressure("swap", num_cpu_blocks=8)
    while sim.sched.num_preemptions == 0:
        out = sim.step()
    assert c.status == SequenceStatus.SWAPPED and list(sim.sched.swapped) == [c]
    held = c.num_computed_tokens
    assert held > 0 and sim.kv.block_ids(c) == []
    assert len(out.blocks_to_swap_out) == len(sim.kv.swapped[c.seq_id]) == -(-held // 4)
    while c.status != SequenceStatus.RUNNING:
        out = sim.step()
    assert len(out.blocks_to_swap_in) == -(-held // 4)
    assert out.num_tokens[out.seqs.index(c)] == 1  # nothing to recompute: straight to decode
    assert c.num_computed_tokens == held + 1
    sim.run()
    assert [s.output_token_ids for s in (a, b, c)] == _reference_outputs()
    assert sim.computed == sum(s.num_tokens - 1 for s in (a, b, c))  # each token computed once
    assert sim.kv.num_free_blocks == 10 and len(sim.kv.cpu_free) == 8


def test_swap_falls_back_to_recompute_without_cpu_room():
    sim, (a, b, c) = _pressure("swap", num_cpu_blocks=1)
    while sim.sched.num_preemptions == 0:
        sim.step()
    assert c.status == SequenceStatus.WAITING and c.num_computed_tokens == 0
    sim.run()
    assert [s.output_token_ids for s in (a, b, c)] == _reference_outputs()


def test_a_swapped_request_resumes_before_waiting_ones_are_admitted():
    sim, (a, b, c) = _pressure("swap", num_cpu_blocks=8)
    while sim.sched.num_preemptions == 0:
        sim.step()
    d = sim.add(prompt(3, 70), max_tokens=2)
    while d.status == SequenceStatus.WAITING:
        out = sim.step()
        assert c.status != SequenceStatus.SWAPPED or d not in out.seqs
    if d in out.seqs:  # admitted in the step that swapped c in: c comes first in the batch
        assert out.seqs.index(c) < out.seqs.index(d)
    sim.run()
    assert d in sim.finished


def test_a_swapped_request_comes_back_only_when_it_can_run():
    # a and c fill a 5-block pool; c is swapped out. Its 2 blocks fit back before the block its
    # next token needs does: swapping it in then would only swap it out again.
    sim = Sim(num_blocks=5, max_num_seqs=4, mode="swap", num_cpu_blocks=8)
    a = sim.add(prompt(8), max_tokens=8)
    c = sim.add(prompt(8, 30), max_tokens=4)
    sim.run()
    assert c.num_preemptions == 1 and sim.sched.num_preemptions == 1
    swap_ins = [o for o in sim.outputs if o.blocks_to_swap_in]
    assert len(swap_ins) == 1 and c in swap_ins[0].seqs
    assert sim.computed == sum(s.num_tokens - 1 for s in (a, c))
    assert len(sim.finished) == 2


# ---- prefix cache -----------------------------------------------------------------------------

def test_prefix_hits_are_counted_once_per_admission():
    sim = Sim(num_blocks=64, max_num_seqs=1)
    a = sim.add(prompt(10), max_tokens=2)
    b = sim.add(prompt(10), max_tokens=2)  # waits several steps behind a (max_num_seqs=1)
    sim.run()
    assert b.num_cached_tokens == 8  # two full blocks of 4 reused, one token recomputed
    assert a.num_cached_tokens == 0
    assert sim.kv.prefix_stats.queries == 20
    assert sim.kv.prefix_stats.hits == 8


def test_cached_tokens_are_those_found_at_admission():
    # b is looked up while a's prompt is still being computed (and does not fit the budget
    # left), then admitted next step, after a's blocks are cached.
    sim = Sim(num_blocks=64, max_num_batched_tokens=16, chunked=False)
    a = sim.add(prompt(12), max_tokens=2)
    b = sim.add(prompt(12), max_tokens=2)
    assert sim.step().seqs == [a]
    assert sim.step().seqs == [a, b]
    assert b.num_cached_tokens == 8 and sim.kv.prefix_stats.hits == 8
    sim.run()
    assert sim.computed == (12 + 1) + (4 + 1)


def test_abort_of_a_waiting_request_leaves_the_others_running():
    sim = Sim(num_blocks=64, max_num_seqs=1)
    a, b, c = (sim.add(prompt(5, 10 * i), max_tokens=3) for i in range(3))
    sim.step()
    sim.sched.finish(b)  # aborted while waiting
    assert b.status == SequenceStatus.FINISHED and list(sim.sched.waiting) == [c]
    sim.run()
    assert sim.finished == [a, c] and sim.kv.num_free_blocks == 64
    assert not sim.kv.hashes and not sim.kv.tables


def test_abort_frees_blocks_from_every_queue():
    sim, (a, b, c) = _pressure("swap", num_cpu_blocks=8)
    d = sim.add(prompt(3, 70), max_tokens=2)
    while sim.sched.num_preemptions == 0:
        sim.step()
    for s in (a, c, d):  # running, swapped, waiting
        sim.sched.finish(s)
        assert s.status == SequenceStatus.FINISHED
    assert sim.sched.running == [b] and not sim.sched.swapped and not sim.sched.waiting
    sim.sched.finish(b)
    assert sim.kv.num_free_blocks == 10 and len(sim.kv.cpu_free) == 8


# ---- everything together ----------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2), st.integers(0, 12),
                            st.integers(1, 9), st.integers(1, 14), st.integers(1, 3)),
                  min_size=1, max_size=10),
    num_blocks=st.integers(9, 24), max_num_seqs=st.integers(1, 6),
    budget=st.integers(4, 32), mode=st.sampled_from(["recompute", "swap", "swap"]),
    cpu=st.sampled_from([0, 6, 32]), caching=st.booleans(), chunked=st.booleans(),
)
def test_every_request_finishes_within_the_limits(reqs, num_blocks, max_num_seqs, budget, mode,
                                                  cpu, caching, chunked):
    """Requests arriving over time, sharing prefixes, under KV pressure: each one finishes, every
    seq reads back its own KV at every step, no batch breaks a limit, every block comes back."""
    sim = Sim(num_blocks, 4, max_num_seqs, budget if chunked else 40, mode, cpu, caching, chunked)
    bases = [prompt(12, 0), prompt(12, 40), [5] * 12]
    arrivals = sorted(reqs, key=lambda r: r[0])
    expected = 0
    steps = 0
    while arrivals or sim.sched.has_unfinished():
        while arrivals and arrivals[0][0] <= steps:
            _, base, keep, extra, max_tokens, n = arrivals.pop(0)
            n = min(n, max_num_seqs)
            sim.add(bases[base][:keep] + prompt(extra, 60 + keep), max_tokens=max_tokens, n=n)
            expected += n
        sim.step()
        steps += 1
        assert steps < 2000, "the scheduler stopped making progress"
    event(f"preempted: {bool(sim.sched.num_preemptions)}")
    event(f"swapped: {any(o.blocks_to_swap_out for o in sim.outputs)}")
    event(f"copy-on-write: {any(o.blocks_to_copy for o in sim.outputs)}")
    event(f"prefix hits: {sim.kv.prefix_stats.hits > 0}")
    assert len(sim.finished) == expected
    # (Sim.step asserted before every forward pass that each seq read back its own tokens.)
    assert all(len(s.output_token_ids) == s.params.max_tokens for s in sim.finished)
    assert max(len(o.seqs) for o in sim.outputs) <= max_num_seqs
    assert max(o.total_tokens for o in sim.outputs) <= sim.config.max_num_batched_tokens
    assert sim.kv.num_free_blocks == num_blocks and len(sim.kv.cpu_free) == cpu
    assert all(b.ref_cnt == 0 for b in sim.kv.pool.blocks)
    # The router's view (events replayed) is the cache, and every cached hash is a block of some
    # request's tokens as block_hashes computes it.
    index: set[str] = set()
    for e in sim.kv.pool.drain_events():
        index = set() if e.kind == "cleared" else index
        index = index | set(e.block_hashes) if e.kind == "stored" else index - set(e.block_hashes)
    assert index == set(sim.kv.pool.cached_hashes())
    known = {h for q in sim.seqs for h in block_hashes(q.all_token_ids, 4, q.extra_keys)}
    assert index <= known
    assert caching or not index


def test_shared_prefix_admitted_in_one_step_is_computed_once() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    shared = list(range(12))  # three full blocks
    a = sim.add(shared + [50, 51])
    b = sim.add(shared + [60, 61, 62])
    c = sim.add([90, 91, 92, 93, 94])  # nothing in common: not held back by b
    first = sim.step()
    assert first.seqs == [a, c]  # b would recompute a's prefix this very step: it waits one step
    assert list(sim.sched.waiting) == [b]
    second = sim.step()
    assert b in second.seqs
    assert b.num_cached_tokens == 12 and second.num_tokens[second.seqs.index(b)] == 3
    assert sim.kv.prefix_stats.hits == 12


def test_no_deferral_without_prefix_caching() -> None:
    sim = Sim(num_blocks=64, block_size=4, max_num_batched_tokens=64, caching=False)
    shared = list(range(12))
    a, b = sim.add(shared + [50]), sim.add(shared + [60])
    assert sim.step().seqs == [a, b]
