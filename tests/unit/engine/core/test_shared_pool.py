"""SharedBlockPool: two models' KV managers over one pool of pages — pages one frees serve the
other, eviction is LRU across models, prefix hits never cross models, a model leaving forgets
its cached pages, the fairness rule, the turn lock; and a stateful test that simulates the
pages' content (each slot holds the model and token written there), so a page handed to two
models at once, or a prefix hit on the other model's page, reads back wrong."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.core.shared_pool import SharedBlockPool, TurnLock
from kvserve.engine.errors import ConfigError
from kvserve.engine.sample.sampling_params import SamplingParams

BS = 4


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams())


def prefill(kv: KVCacheManager, seq: Sequence) -> bool:
    hits = kv.lookup_prefix(seq)
    if not kv.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits):
        return False
    seq.num_computed_tokens = seq.num_tokens
    kv.register_computed(seq)
    return True


def two_models(pages: int = 8, fair: bool = True) -> tuple[SharedBlockPool, KVCacheManager,
                                                            KVCacheManager]:
    shared = SharedBlockPool(pages, 1024, fair=fair)
    shared.join("a", 1024)
    shared.join("b", 256)
    a = KVCacheManager(pages, BS, shared=shared, member="a", model_key=None)
    b = KVCacheManager(pages, BS, shared=shared, member="b", model_key="b")
    return shared, a, b


def test_a_model_whose_block_exceeds_the_page_is_refused_by_name():
    shared = SharedBlockPool(4, 1024)
    with pytest.raises(ConfigError, match="'big'.*2048 bytes per block.*1024"):
        shared.join("big", 2048)
    shared.join("a", 512)
    with pytest.raises(ConfigError, match="already"):
        shared.join("a", 512)
    assert shared.waste("a") == 0.5


def test_pages_one_model_frees_serve_a_burst_on_the_other():
    _, a, b = two_models(8)
    seqs = [seq_of(i, [i] * 8) for i in range(4)]  # 2 pages each: the whole pool
    assert all(prefill(a, s) for s in seqs)
    assert a.num_free_blocks == 0 and a.num_held_blocks() == 8
    burst = seq_of(9, [7] * 16)
    assert not prefill(b, burst)  # nothing free
    for s in seqs[:2]:
        a.free(s)
    assert prefill(b, burst)
    assert b.num_held_blocks() == 4 and a.num_held_blocks() == 4 and b.num_free_blocks == 0


def test_prefix_hits_never_cross_models_but_stay_within_one():
    _, a, b = two_models(8)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    first = seq_of(1, tokens)
    assert prefill(a, first)
    assert b.lookup_prefix(seq_of(2, tokens)) == []  # the same tokens, another model
    assert len(a.lookup_prefix(seq_of(3, tokens))) == 2
    on_b = seq_of(4, tokens)
    assert prefill(b, on_b)
    assert len(b.lookup_prefix(seq_of(5, tokens))) == 2
    assert set(a.block_ids(first)).isdisjoint(b.block_ids(on_b))


def test_eviction_is_least_recently_freed_first_across_models():
    _, a, b = two_models(4)
    old = seq_of(1, [1] * 4 + [9])  # a's cached page, freed first
    assert prefill(a, old)
    a.free(old)
    new = seq_of(2, [2] * 4 + [9])  # b's cached page, freed later
    assert prefill(b, new)
    b.free(new)
    taker = seq_of(3, [5] * 12)  # 3 pages: the 2 uncached ones, then the oldest cached
    assert prefill(a, taker)
    assert a.lookup_prefix(seq_of(4, [1] * 4 + [9])) == []
    assert len(b.lookup_prefix(seq_of(5, [2] * 4 + [9]))) == 1


def test_a_model_leaving_forgets_its_cached_pages():
    shared, a, b = two_models(4)
    s = seq_of(1, [6] * 8 + [1])
    assert prefill(b, s)
    b.free(s)
    assert shared.leave("b") == 2
    again = KVCacheManager(4, BS, shared=shared, member="b", model_key="b")
    shared.join("b", 256)
    assert again.lookup_prefix(seq_of(2, [6] * 8 + [1])) == []
    assert shared.pool.num_free_blocks == 4


def test_a_model_over_its_share_admits_nothing_new_while_the_other_waits():
    shared, a, b = two_models(8)
    for i in range(3):  # 6 of 8 pages: over an equal share of 4
        assert prefill(a, seq_of(i, [i] * 8))
    a.report_load(waiting=True)
    b.report_load(waiting=False)
    assert a.may_admit()  # nobody else waits
    b.report_load(waiting=True)
    assert not a.may_admit() and b.may_admit()
    unfair = SharedBlockPool(8, 1024, fair=False)
    unfair.join("a", 1024)
    unfair.join("b", 1024)
    unfair.report("a", True)
    unfair.report("b", True)
    assert unfair.may_admit("a", lambda: 8)


def test_the_turn_lock_excludes_reenters_and_serves_in_arrival_order():
    lock, order, inside = TurnLock(), [], []
    started = [threading.Event() for _ in range(3)]

    def worker(i: int) -> None:
        started[i].set()
        with lock:
            inside.append(i)
            assert len(inside) == 1
            order.append(i)
            inside.pop()

    with lock:
        with lock:  # re-entrant
            threads = []
            for i in range(3):  # queued one after the other while the lock is held
                t = threading.Thread(target=worker, args=(i,))
                t.start()
                started[i].wait()
                while lock._next != i + 2:  # its ticket is drawn
                    pass
                threads.append(t)
    for t in threads:
        t.join()
    assert order == [0, 1, 2]


class SharedPoolMachine(RuleBasedStateMachine):
    """Sequences of two models (sharing token prefixes across models on purpose) are admitted,
    decode and finish over one pool; every page's simulated content (model, token) must read
    back as each running sequence's own tokens, and the pool's count must add up."""

    pages = 12

    def __init__(self) -> None:
        super().__init__()
        self.shared, a, b = two_models(self.pages, fair=False)
        self.kv = {"a": a, "b": b}
        self.mem: dict[int, list[tuple[str, int] | None]] = {
            p: [None] * BS for p in range(self.pages)}
        self.running: dict[int, tuple[str, Sequence]] = {}
        self.next_id = 0

    def _write(self, model: str, seq: Sequence, start: int, end: int) -> None:
        table = self.kv[model].block_ids(seq)
        for pos in range(start, end):
            self.mem[table[pos // BS]][pos % BS] = (model, seq.all_token_ids[pos])

    @rule(model=st.sampled_from(["a", "b"]), base=st.integers(0, 1), extra=st.integers(0, 6))
    def admit(self, model: str, base: int, extra: int) -> None:
        self.next_id += 1
        tokens = [[1, 2, 3, 4] * 2, [2, 2, 1, 1] * 2][base] + [5 + extra] * extra
        seq = seq_of(self.next_id, tokens)
        kv = self.kv[model]
        hits = kv.lookup_prefix(seq)
        if not kv.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits):
            return
        self._write(model, seq, len(hits) * BS, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.register_computed(seq)
        self.running[seq.seq_id] = (model, seq)

    @rule(k=st.integers(0, 50), token=st.integers(1, 4))
    def decode(self, k: int, token: int) -> None:
        if not self.running:
            return
        model, seq = list(self.running.values())[k % len(self.running)]
        seq.output_token_ids.append(token)
        if not self.kv[model].allocate_slots(seq, 1):
            seq.output_token_ids.pop()
            return
        self._write(model, seq, seq.num_tokens - 1, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.kv[model].register_computed(seq)

    @rule(k=st.integers(0, 50))
    def finish(self, k: int) -> None:
        if self.running:
            sid = list(self.running)[k % len(self.running)]
            model, seq = self.running.pop(sid)
            self.kv[model].free(seq)

    @invariant()
    def each_sequence_reads_its_own_model_and_tokens(self) -> None:
        for model, seq in self.running.values():
            table = self.kv[model].block_ids(seq)
            got = [self.mem[table[p // BS]][p % BS] for p in range(seq.num_computed_tokens)]
            assert got == [(model, t) for t in seq.all_token_ids[:seq.num_computed_tokens]]

    @invariant()
    def held_and_free_pages_add_up(self) -> None:
        held = set()
        for model, seq in self.running.values():
            held |= set(self.kv[model].block_ids(seq))
        assert len(held) + self.shared.pool.num_free_blocks == self.pages
        assert sum(kv.num_held_blocks() for kv in self.kv.values()) == len(held)


TestSharedPoolMachine = SharedPoolMachine.TestCase
TestSharedPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
