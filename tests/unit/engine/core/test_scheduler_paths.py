"""Scheduler paths the step-loop tests of test_scheduler.py leave open (mutation survivors, see
docs/mutation.md): the swap-or-recompute choice with a cost model, the priority order of the
running set, a prompt exactly at the budget without chunking, the cached-token figure of a
re-admitted request, a two-token prefill chunk that completes a shared block, prefix hits
from the host and disk tiers, and the swapped queue's share of the budget."""

from __future__ import annotations

from test_scheduler import Sim, prompt

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.scheduler import Scheduler, SchedulerConfig
from kvserve.engine.core.sequence import Sequence, SequenceStatus
from kvserve.engine.kv_offload.disk_block_file import HEADER_SIZE as FILE_HEADER
from kvserve.engine.kv_offload.disk_tier import DiskTier
from kvserve.engine.sample.sampling_params import SamplingParams


class Advisor:
    """A swap cost model with a fixed answer that records what it was asked."""

    def __init__(self, swap: bool) -> None:
        self.swap = swap
        self.asked: list[tuple[int, int]] = []

    def prefer_swap(self, num_blocks: int, num_tokens: int) -> bool:
        self.asked.append((num_blocks, num_tokens))
        return self.swap


def _pressure_with(mode: str, advisor: Advisor | None) -> tuple[Sim, list[Sequence]]:
    """test_scheduler's three requests outgrowing a 10-block pool, with a CPU pool with room."""
    sim = Sim(num_blocks=10, max_num_seqs=4, mode=mode, num_cpu_blocks=8)
    sim.sched = Scheduler(sim.config, sim.kv, swap_advisor=advisor)
    seqs = [sim.add(prompt(7, 30 * i), max_tokens=9) for i in range(3)]
    return sim, seqs


def _until_preempted(sim: Sim):
    while sim.sched.num_preemptions == 0:
        out = sim.step()
    return out


def test_auto_preemption_recomputes_when_the_cost_model_says_so():
    sim, (a, b, c) = _pressure_with("auto", Advisor(swap=False))
    held = None
    while sim.sched.num_preemptions == 0:
        held = c.num_computed_tokens
        out = sim.step()
    assert c.status == SequenceStatus.WAITING and out.blocks_to_swap_out == []
    # Asked once, about the victim: its device blocks and its computed tokens.
    assert sim.sched.swap_advisor.asked == [(-(-held // 4), held)]
    sim.run()
    assert len(sim.finished) == 3 and sim.kv.num_free_blocks == 10


def test_auto_preemption_swaps_when_the_cost_model_says_so():
    sim, (a, b, c) = _pressure_with("auto", Advisor(swap=True))
    out = _until_preempted(sim)
    assert c.status == SequenceStatus.SWAPPED and out.blocks_to_swap_out
    assert len(sim.sched.swap_advisor.asked) == 1
    sim.run()
    assert sim.computed == sum(s.num_tokens - 1 for s in (a, b, c))  # nothing recomputed


def test_swap_mode_swaps_whatever_a_cost_model_would_say():
    sim, (a, b, c) = _pressure_with("swap", Advisor(swap=False))
    out = _until_preempted(sim)
    assert c.status == SequenceStatus.SWAPPED and out.blocks_to_swap_out
    assert sim.sched.swap_advisor.asked == []


def test_auto_preemption_without_a_cost_model_swaps():
    sim, (a, b, c) = _pressure_with("auto", None)
    _until_preempted(sim)
    assert c.status == SequenceStatus.SWAPPED


def test_priority_gives_the_running_budget_to_the_most_urgent_first():
    sim = Sim(num_blocks=64, max_num_batched_tokens=8)
    sim.config = SchedulerConfig(8, 8, 1024, True, "recompute", "priority")
    sim.sched = Scheduler(sim.config, sim.kv)
    late = Sequence(1, "late", 0, prompt(12), SamplingParams(max_tokens=4), priority=5)
    sim.sched.add(late)
    assert sim.step().num_tokens == [8]
    urgent = Sequence(2, "urgent", 0, prompt(12, 40), SamplingParams(max_tokens=4), priority=0)
    sim.sched.add(urgent)
    second = sim.step()  # late's last 4 prompt tokens, then urgent's first 4
    assert second.seqs == [late, urgent] and second.num_tokens == [4, 4]
    third = sim.step()  # urgent's 8 remaining tokens take the whole budget before late's decode
    assert third.seqs == [urgent] and third.num_tokens == [8]


def test_without_chunking_a_prompt_of_exactly_the_budget_runs_at_once():
    sim = Sim(num_blocks=64, max_num_batched_tokens=16, chunked=False)
    a = sim.add(prompt(16))
    first = sim.step()
    assert first.seqs == [a] and first.num_tokens == [16]


def test_a_re_admitted_request_keeps_the_cached_tokens_of_its_first_admission():
    # c found nothing cached when first admitted; recomputed after its preemption, it finds its
    # own blocks cached, but num_cached_tokens reports what the request got at admission.
    sim = Sim(num_blocks=10, max_num_seqs=4)
    a, b, c = (sim.add(prompt(7, 30 * i), max_tokens=9) for i in range(3))
    _until_preempted(sim)
    assert c.num_cached_tokens == 0
    while c.status != SequenceStatus.RUNNING:
        sim.step()
    assert c.num_computed_tokens > 4  # re-admitted from its cached blocks
    assert c.num_cached_tokens == 0


def test_a_two_token_chunk_that_completes_a_block_defers_a_request_that_needs_it():
    # a's prompt: 8 tokens over a budget of 6, so its second chunk is 2 tokens completing block 1.
    # b shares both blocks and arrives then: it waits a step and hits block 1 instead of
    # computing it again.
    sim = Sim(num_blocks=64, max_num_batched_tokens=6)
    shared = prompt(8)
    a = sim.add(shared, max_tokens=2)
    assert sim.step().num_tokens == [6]
    b = sim.add(shared + prompt(4, 50), max_tokens=2)
    second = sim.step()
    assert second.seqs == [a] and second.num_tokens == [2]
    sim.run()
    assert b.num_cached_tokens == 8


# ---- the host and disk tiers under the scheduler -------------------------------------------

class TierSim(Sim):
    """Sim with a host tier (and a disk tier): the moves applied in the runner's order
    (ModelRunner.apply_moves): spills, offloads, restores, loads, then the rest. A block's
    payload on disk is its 4 token ids as bytes."""

    def __init__(self, num_blocks: int, num_host_blocks: int, disk: DiskTier | None = None
                 ) -> None:
        super().__init__(num_blocks, block_size=4)
        self.kv = KVCacheManager(num_blocks, 4, True, 0, num_host_blocks, disk)
        self.sched = Scheduler(self.config, self.kv)
        self.host: dict[int, int] = {}
        self.disk = disk

    def _block(self, mem: dict[int, int], index: int) -> list[int]:
        return [mem[index * self.bs + o] for o in range(self.bs)]

    def _move(self, out) -> None:
        for medium, index, block_hash in out.blocks_to_spill:
            toks = self._block(self.dev if medium == "device" else self.host, index)
            assert self.disk.put(block_hash, bytearray(toks), wait=True)
        for d, h in out.blocks_to_offload:
            for o, tok in enumerate(self._block(self.dev, d)):
                self.host[h * self.bs + o] = tok
        for h, d in out.blocks_to_restore:
            for o, tok in enumerate(self._block(self.host, h)):
                self.dev[d * self.bs + o] = tok
        for payload, d in out.blocks_to_load:
            for o, tok in enumerate(payload):
                self.dev[d * self.bs + o] = tok
        super()._move(out)


def test_prefix_hits_from_the_host_tier_are_counted_as_host_hits():
    # a's two full blocks are evicted from a 4-block pool by b, kept by the host tier, and
    # restored for c, which has a's prompt (Sim.step checks c reads back its own tokens).
    sim = TierSim(num_blocks=4, num_host_blocks=8)
    sim.add(prompt(9), max_tokens=2)
    sim.run()
    sim.add(prompt(13, 40), max_tokens=2)
    sim.run()
    assert len(sim.kv.host) >= 2
    c = sim.add(prompt(9), max_tokens=2)
    sim.run()
    assert c.num_cached_tokens == 8
    stats = sim.kv.prefix_stats
    assert (stats.hits, stats.host_hits, stats.disk_hits) == (8, 8, 0)


def test_prefix_hits_from_the_disk_tier_are_counted_as_disk_hits(tmp_path):
    # As above with a 2-slot host tier: c's blocks push a's on to the disk tier, from where d,
    # with a's prompt, loads them.
    disk = DiskTier(tmp_path, 64 * (FILE_HEADER + 4), 4, "scheduler-test")
    try:
        sim = TierSim(num_blocks=4, num_host_blocks=2, disk=disk)
        sim.add(prompt(9), max_tokens=2)
        sim.run()
        sim.add(prompt(13, 40), max_tokens=2)
        sim.run()
        sim.add(prompt(13, 60), max_tokens=2)
        sim.run()
        assert len(disk) >= 2
        d = sim.add(prompt(9), max_tokens=2)
        sim.run()
        assert d.num_cached_tokens == 8
        stats = sim.kv.prefix_stats
        assert (stats.hits, stats.host_hits, stats.disk_hits) == (8, 0, 8)
        figures = sim.kv.make_stats()
        assert figures.disk.restored == 2 and figures.prefix_cache_disk_hits == 8
    finally:
        disk.close()


def test_a_spent_budget_admits_nobody_with_zero_tokens():
    sim = Sim(num_blocks=64, max_num_batched_tokens=8)
    a = sim.add(prompt(8))
    sim.add(prompt(4, 50))
    first = sim.step()
    assert first.seqs == [a] and first.num_tokens == [8]



def test_the_last_token_of_the_budget_is_given_out():
    # A budget of 2: a's decode takes 1 and b gets the last one, first as a new admission,
    # then as a running prefill.
    sim = Sim(num_blocks=64, max_num_batched_tokens=2)
    a = sim.add(prompt(2), max_tokens=4)
    sim.step()
    b = sim.add(prompt(2, 50), max_tokens=2)
    second, third = sim.step(), sim.step()
    assert (second.seqs, second.num_tokens) == ([a, b], [1, 1])
    assert (third.seqs, third.num_tokens) == ([a, b], [1, 1])


def test_a_decode_completing_a_block_holds_back_no_admission():
    # b's prompt is a's prompt and first output token: its next block is the one a's decode
    # completes this step. Only prefill chunks defer a request; b is admitted at once.
    sim = Sim(num_blocks=64, max_num_batched_tokens=64)
    a = sim.add(prompt(7), max_tokens=3)
    sim.step()
    b = sim.add(a.all_token_ids + [80], max_tokens=2)
    second = sim.step()
    assert second.seqs == [a, b] and b.num_cached_tokens == 4


# ---- the swapped queue's share of the budget ----------------------------------------------------

def _swapped_fork(sim: Sim, parent: Sequence) -> Sequence:
    """Step until a fork is swapped out; return it (its parent finished in that step)."""
    while not sim.sched.swapped:
        sim.step()
    (fork,) = sim.sched.swapped
    assert fork.request_id == parent.request_id and parent in sim.finished
    return fork


def test_a_swapped_seq_stays_out_while_the_running_ones_spend_the_budget():
    # a (n=2) forks after its prefill; the fork, the newest seq, is swapped out when a's decode
    # needs a block, and a then finishes. Next step b's prefill takes the whole budget of 2: the
    # fork stays on the CPU (it would run no token) although the pool has room for its blocks.
    sim = Sim(num_blocks=4, max_num_seqs=3, max_num_batched_tokens=2, mode="swap",
              num_cpu_blocks=8)
    a = sim.add(prompt(7, 21), max_tokens=3, n=2)
    for _ in range(3):
        sim.step()
    b = sim.add(prompt(10, 18), max_tokens=4)
    fork = _swapped_fork(sim, a)
    assert sim.kv.can_swap_in(fork)
    spent = sim.step()
    assert (spent.seqs, spent.num_tokens, spent.blocks_to_swap_in) == ([b], [2], [])
    assert fork.status == SequenceStatus.SWAPPED
    sim.run()
    assert all(n > 0 for o in sim.outputs for n in o.num_tokens)
    assert len(fork.output_token_ids) == 3 and sim.kv.num_free_blocks == 4


def test_a_swapped_seq_takes_the_last_token_of_the_budget():
    # As above with b (n=2) admitted as a decodes: b's fork is swapped out and a's fork decodes
    # one token of the budget of 2; b's fork is swapped in for the last one in the same step.
    sim = Sim(num_blocks=5, max_num_seqs=5, max_num_batched_tokens=2, mode="swap",
              num_cpu_blocks=4)
    a = sim.add(prompt(9, 77), max_tokens=2, n=2)
    sim.step(), sim.step()
    b = sim.add(prompt(1), max_tokens=2, n=2)
    fork = _swapped_fork(sim, b)
    (a_fork,) = [s for s in sim.sched.running if s.request_id == a.request_id]
    last = sim.step()
    assert (last.seqs, last.num_tokens) == ([a_fork, fork], [1, 1])
    assert last.blocks_to_swap_in and len(fork.output_token_ids) == 2  # its last token
