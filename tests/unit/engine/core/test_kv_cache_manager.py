"""KVCacheManager: lazy allocation, prefix lookup/registration, fork with copy-on-write, swap.

The stateful test drives the manager the way the scheduler and engine do and simulates the KV
memory itself (each slot holds the token whose K/V it caches), so a block shared, evicted, copied
or swapped wrongly shows up as a sequence reading back tokens that are not its own.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.engine.core.block_hash import block_hashes_bytes
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.sample.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id: int, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(), cache_salt=salt)


def prefill(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit and fully compute a seq as the scheduler and engine do (prefix hits included)."""
    hits = kv.lookup_prefix(seq)
    assert kv.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    seq.num_computed_tokens = seq.num_tokens
    kv.register_computed(seq)


def test_blocks_are_taken_only_when_a_token_needs_them():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    seq = make_seq(1, [5] * 6)
    assert kv.allocate_slots(seq, 3)
    assert len(kv.block_ids(seq)) == 1
    seq.num_computed_tokens = 3
    assert kv.allocate_slots(seq, 3)  # tokens 3..5 span the rest of block 0 and block 1
    assert len(kv.block_ids(seq)) == 2
    seq.num_computed_tokens = 6
    seq.output_token_ids.append(7)
    assert kv.allocate_slots(seq, 1)  # slot 6 is still in block 1
    assert len(kv.block_ids(seq)) == 2 and kv.num_free_blocks == 6


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    assert not kv.allocate_slots(make_seq(1, [1] * 13), 13)
    assert kv.num_free_blocks == 3 and kv.block_ids(make_seq(1, [1])) == []


def test_a_shared_prompt_prefix_is_found_and_shared():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(kv, a)
    b = make_seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 4, 4])
    hits = kv.lookup_prefix(b)
    assert [h.block_id for h in hits] == kv.block_ids(a)[:2]
    prefill(kv, b)
    assert kv.block_ids(b)[:2] == kv.block_ids(a)[:2]
    assert [blk.ref_cnt for blk in kv.tables[1][:2]] == [2, 2]
    assert kv.num_free_blocks == 8 - 3 - 1


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(kv, make_seq(1, [1] * 8))
    assert len(kv.lookup_prefix(make_seq(2, [1] * 8))) == 1  # block 2 would leave nothing
    assert len(kv.lookup_prefix(make_seq(3, [1] * 9))) == 2


def test_freed_prompt_blocks_serve_a_later_request():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq(1, [3] * 10)
    prefill(kv, a)
    ids = kv.block_ids(a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_seq(2, [3] * 10)
    assert [h.block_id for h in kv.lookup_prefix(b)] == ids[:2]
    prefill(kv, b)
    assert kv.num_free_blocks == 1


def test_a_freed_sequence_loses_the_end_of_its_chain_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_seq(1, [4] * 4 + [5] * 4 + [6] * 4 + [7])  # 3 full blocks + 1 partial
    prefill(kv, a)
    ids = kv.block_ids(a)
    kv.free(a)
    b = make_seq(2, [1] * 5)
    prefill(kv, b)  # 2 blocks: the partial one (nothing to keep), then the chain's last block
    assert sorted(kv.block_ids(b)) == sorted([ids[3], ids[2]])
    assert [blk.block_id for blk in kv.lookup_prefix(make_seq(3, a.all_token_ids))] == ids[:2]


def test_hits_on_free_cached_blocks_count_against_the_free_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_seq(1, [3] * 9)
    prefill(kv, a)
    kv.free(a)
    # 2 free hits + 2 new blocks > 3 free blocks: must refuse without touching anything.
    b = make_seq(2, [3] * 8 + [4] * 5)
    hits = kv.lookup_prefix(b)
    assert len(hits) == 2
    assert not kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 3 and all(h.ref_cnt == 0 for h in hits)


def test_fork_shares_blocks_and_the_first_write_copies_the_partial_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(1, [1, 2, 3, 4, 5, 6])
    prefill(kv, parent)
    child = make_seq(2, parent.prompt_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent)
    assert kv.pool.num_shared_blocks() == 2 and kv.num_free_blocks == 6
    shared_last = kv.block_ids(parent)[-1]
    child.output_token_ids.append(9)
    assert kv.allocate_slots(child, 1)
    new_last = kv.block_ids(child)[-1]
    assert kv.take_pending_copies() == [(shared_last, new_last)]
    assert kv.block_ids(child)[0] == kv.block_ids(parent)[0]  # the full block stays shared
    parent.output_token_ids.append(8)
    assert kv.allocate_slots(parent, 1)  # now private again: written in place
    assert kv.take_pending_copies() == [] and kv.block_ids(parent)[-1] == shared_last
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_swap_out_and_in_keeps_the_table_length_and_returns_every_block():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [2] * 10)
    prefill(kv, seq)
    table = kv.block_ids(seq)
    assert kv.can_swap_out(seq)
    out = kv.swap_out(seq)
    assert [d for d, _ in out] == table and kv.num_free_blocks == 6
    assert len(kv.cpu_free) == 1 and kv.block_ids(seq) == []
    assert kv.can_swap_in(seq)
    back = kv.swap_in(seq)
    assert [c for c, _ in back] == [c for _, c in out]
    assert len(kv.block_ids(seq)) == 3 and len(kv.cpu_free) == 4
    kv.free(seq)
    assert kv.num_free_blocks == 6


def test_swap_needs_room_on_the_other_side():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=2)
    seq = make_seq(1, [2] * 10)
    prefill(kv, seq)
    assert not kv.can_swap_out(seq)
    kv2 = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    a, b = make_seq(1, [1] * 10), make_seq(2, [2] * 4)
    prefill(kv2, a)
    kv2.swap_out(a)
    prefill(kv2, b)
    prefill(kv2, make_seq(3, [3] * 5))
    assert not kv2.can_swap_in(a)  # 3 blocks needed, 1 free


def test_can_swap_in_counts_the_slots_of_the_next_tokens():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [1] * 8)
    prefill(kv, seq)  # 2 full blocks
    kv.swap_out(seq)
    prefill(kv, make_seq(2, [2] * 5))  # 2 blocks: 2 left
    seq.output_token_ids.append(3)
    assert kv.can_swap_in(seq)  # its 2 blocks fit...
    assert not kv.can_swap_in(seq, 1)  # ...but not the third its next token needs
    assert kv.can_swap_in(seq, 0)


def test_freeing_a_swapped_seq_returns_its_cpu_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [1] * 7)
    prefill(kv, seq)
    kv.swap_out(seq)
    kv.free(seq)
    assert len(kv.cpu_free) == 4 and kv.num_free_blocks == 4


def test_prefix_stats_count_what_is_recorded():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.record_lookup(10, 8)
    kv.record_lookup(6, 0)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (16, 8)
    off = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=False)
    prefill(off, make_seq(1, [1] * 9))
    off.record_lookup(9, 0)
    assert off.lookup_prefix(make_seq(2, [1] * 9)) == []
    assert off.prefix_stats.queries == 0 and off.pool.cached_hashes() == []



def test_make_stats_describes_blocks_tables_and_lookups():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_cpu_blocks=4)
    a, b = make_seq(1, [7] * 9), make_seq(2, [7] * 9)
    prefill(kv, a)  # 3 blocks, the first 2 full and cached
    prefill(kv, b)  # hits a's 2 full blocks, so they are shared; 1 block of its own
    kv.record_lookup(9, 8)
    kv.swap_out(b)
    stats = kv.make_stats()
    assert (stats.num_total_blocks, stats.num_free_blocks) == (8, 5)
    assert stats.usage == pytest.approx(3 / 8) and stats.allocated_slots == 3 * BS
    assert (stats.num_cached_blocks, stats.num_shared_blocks) == (2, 0)
    assert (stats.num_cpu_blocks, stats.num_free_cpu_blocks) == (4, 1)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 8)
    assert kv.num_blocks_of(a) == 3 and kv.num_blocks_of(b) == 0
    assert kv.make_stats() == stats  # a snapshot: reading it changes nothing


def test_alloc_seconds_are_taken_once():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    start = time.perf_counter()
    prefill(kv, make_seq(1, [1] * 5))
    prefill(kv, make_seq(2, [2] * 5))
    span = time.perf_counter() - start
    taken = kv.take_alloc_seconds()
    # Durations of the calls, each within the time that both took (a bound, not a speed).
    assert len(taken) == 2 and all(0 <= t <= span for t in taken)
    assert kv.take_alloc_seconds() == []


class KVMemory:
    """Simulated device and CPU KV memory: slot -> token id written there (None = never)."""

    def __init__(self, num_blocks: int, num_cpu_blocks: int) -> None:
        self.dev: list[list[int | None]] = [[None] * BS for _ in range(num_blocks)]
        self.cpu: list[list[int | None]] = [[None] * BS for _ in range(num_cpu_blocks)]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.dev[dst] = list(self.dev[src])

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        for d, c in pairs:
            self.cpu[c] = list(self.dev[d])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        for c, d in pairs:
            self.dev[d] = list(self.cpu[c])

    def write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        for p in range(start, end):
            self.dev[table[p // BS]][p % BS] = tokens[p]

    @staticmethod
    def read(mem: list[list[int | None]], table: list[int], n: int) -> list[int | None]:
        return [mem[table[p // BS]][p % BS] for p in range(n)]


class KVCacheMachine(RuleBasedStateMachine):
    """Sequences sharing random prefixes go through admission, chunked prefill, decode, fork,
    swap and free; the invariants hold after every step."""

    caching = True
    num_blocks = 24
    num_cpu_blocks = 8

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.num_blocks, BS, self.caching, self.num_cpu_blocks)
        self.mem = KVMemory(self.num_blocks, self.num_cpu_blocks)
        self.running: dict[int, Sequence] = {}
        self.swapped: dict[int, Sequence] = {}
        self.pending: dict[int, int] = {}  # seq id -> tokens allocated but not computed yet
        self.hash_tokens: dict[bytes, list[int]] = {}  # block hash -> the tokens it stands for
        self.next_id = 0
        self.bases = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [2, 2, 2, 2, 1, 1, 1, 1, 3, 3, 3, 3]]

    # ---- helpers ------------------------------------------------------------------------------
    def _pick(self, seqs: dict[int, Sequence], k: int, pred=lambda s: True) -> Sequence | None:
        cands = [s for s in seqs.values() if pred(s)]
        return cands[k % len(cands)] if cands else None

    def _snapshot(self) -> tuple:
        return (self.kv.num_free_blocks, [b.ref_cnt for b in self.kv.pool.blocks],
                {k: list(v) for k, v in self.kv.tables.items()}, len(self.kv.pending_copies))

    def _allocate(self, seq: Sequence, n: int, hits=None) -> bool:
        """allocate_slots, then check copy-on-write left the blocks to be written private."""
        before = self._snapshot()
        old_table = self.kv.block_ids(seq)
        ok = self.kv.allocate_slots(seq, n, hits)
        if not ok:
            assert self._snapshot() == before, "a failed allocate_slots changed the pool"
            return False
        copies = self.kv.take_pending_copies()
        table = self.kv.block_ids(seq)
        start = seq.num_computed_tokens + (len(hits) * BS if hits else 0)
        for src, dst in copies:
            assert 0 <= src < self.num_blocks and 0 <= dst < self.num_blocks and src != dst
            assert src == old_table[start // BS] and dst == table[start // BS]
            assert self.kv.pool.blocks[src].ref_cnt >= 1, "copy source was freed before the copy"
        self.mem.copy(copies)
        return True

    def _schedule(self, seq: Sequence, chunk: int) -> bool:
        n = min(seq.num_tokens - seq.num_computed_tokens, chunk)
        if not self._allocate(seq, n):
            return False
        self.pending[seq.seq_id] = n
        return True

    def _record_hashes(self, seq: Sequence) -> None:
        toks = seq.all_token_ids
        for i, hsh in enumerate(block_hashes_bytes(toks, BS, seq.extra_keys)):
            self.hash_tokens[hsh] = toks[i * BS : (i + 1) * BS]

    def _idle(self) -> list[Sequence]:
        """Running seqs with nothing allocated-but-uncomputed (between two steps)."""
        return [s for s in self.running.values() if not self.pending.get(s.seq_id)]

    def _computed(self) -> list[Sequence]:
        return [s for s in self._idle() if s.num_computed_tokens == s.num_tokens]

    def _prefilling(self) -> list[Sequence]:
        return [s for s in self._idle() if s.num_computed_tokens < s.num_tokens]

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ---- rules --------------------------------------------------------------------------------
    @rule(base=st.integers(0, 1), keep=st.integers(0, 12),
          suffix=st.lists(st.integers(1, 3), max_size=10), salt=st.sampled_from([None, None, "t"]),
          chunk=st.integers(1, 16))
    def admit(self, base, keep, suffix, salt, chunk):
        tokens = self.bases[base][:keep] + suffix
        if not tokens:
            return
        seq = make_seq(self._new_id(), tokens, salt)
        self._record_hashes(seq)
        hits = self.kv.lookup_prefix(seq)
        assert len(hits) * BS < seq.num_tokens, "a lookup must leave a token to compute"
        for i, b in enumerate(hits):
            assert self.hash_tokens[b.block_hash] == tokens[i * BS : (i + 1) * BS]
        cached = len(hits) * BS
        n = min(seq.num_tokens - cached, chunk)
        if not self._allocate(seq, n, hits):
            self.kv.free(seq)  # a waiting request that is aborted
            return
        seq.num_computed_tokens = cached
        self.pending[seq.seq_id] = n
        self.running[seq.seq_id] = seq

    @precondition(lambda self: any(self.pending.values()))
    @rule(k=st.integers(0, 99))
    def compute(self, k):
        """One forward pass over the seq's scheduled tokens, then register the full blocks."""
        seq = self._pick(self.running, k, lambda s: self.pending.get(s.seq_id, 0) > 0)
        n = self.pending.pop(seq.seq_id)
        start = seq.num_computed_tokens
        self.mem.write(self.kv.block_ids(seq), seq.all_token_ids, start, start + n)
        seq.num_computed_tokens += n
        self.kv.register_computed(seq)

    @precondition(lambda self: any(self._prefilling()))
    @rule(k=st.integers(0, 99), chunk=st.integers(1, 16))
    def schedule_rest(self, k, chunk):
        """The next prefill chunk of a seq whose prompt is not fully computed."""
        seq = self._pick(self.running, k, lambda s: not self.pending.get(s.seq_id)
                         and s.num_computed_tokens < s.num_tokens)
        if seq is not None:
            self._schedule(seq, chunk)

    @precondition(lambda self: any(self._computed()))
    @rule(k=st.integers(0, 99), tok=st.integers(1, 3))
    def decode(self, k, tok):
        """Sample a token for a fully computed seq and make room for it."""
        seq = self._pick(self.running, k, lambda s: not self.pending.get(s.seq_id)
                         and s.num_computed_tokens == s.num_tokens)
        if seq is None:
            return
        seq.output_token_ids.append(tok)
        self._record_hashes(seq)
        self._schedule(seq, 1)

    @precondition(lambda self: any(self._computed()))
    @rule(k=st.integers(0, 99))
    def fork(self, k):
        parent = self._pick(self.running, k, lambda s: not self.pending.get(s.seq_id)
                            and s.num_computed_tokens == s.num_tokens)
        if parent is None:
            return
        child = make_seq(self._new_id(), parent.prompt_token_ids, parent.cache_salt)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        assert self.kv.block_ids(child) == self.kv.block_ids(parent)
        self.running[child.seq_id] = child

    @precondition(lambda self: any(self._idle()))
    @rule(k=st.integers(0, 99))
    def swap_out(self, k):
        seq = self._pick(self.running, k, lambda s: not self.pending.get(s.seq_id))
        if seq is None or not self.kv.can_swap_out(seq):
            return
        table = self.kv.block_ids(seq)
        pairs = self.kv.swap_out(seq)
        assert [d for d, _ in pairs] == table
        self.mem.swap_out(pairs)
        del self.running[seq.seq_id]
        self.swapped[seq.seq_id] = seq

    @precondition(lambda self: bool(self.swapped))
    @rule(k=st.integers(0, 99))
    def swap_in(self, k):
        seq = self._pick(self.swapped, k)
        if seq is None or not self.kv.can_swap_in(seq):
            return
        cpu = list(self.kv.swapped[seq.seq_id])
        pairs = self.kv.swap_in(seq)
        assert [c for c, _ in pairs] == cpu
        self.mem.swap_in(pairs)
        del self.swapped[seq.seq_id]
        self.running[seq.seq_id] = seq

    @precondition(lambda self: bool(self.running or self.swapped))
    @rule(k=st.integers(0, 99), from_swapped=st.booleans())
    def free(self, k, from_swapped):
        pool = self.swapped if from_swapped else self.running
        seq = self._pick(pool, k)
        if seq is None:
            return
        self.kv.free(seq)
        del pool[seq.seq_id]
        self.pending.pop(seq.seq_id, None)

    @precondition(lambda self: any(self._idle()))
    @rule(k=st.integers(0, 99))
    def preempt_by_recompute(self, k):
        """Free a running seq and admit it again from scratch, as the scheduler does."""
        seq = self._pick(self.running, k, lambda s: not self.pending.get(s.seq_id))
        if seq is None:
            return
        self.kv.free(seq)
        del self.running[seq.seq_id]
        seq.num_computed_tokens = 0
        hits = self.kv.lookup_prefix(seq)
        if self._allocate(seq, seq.num_tokens - len(hits) * BS, hits):
            seq.num_computed_tokens = len(hits) * BS
            self.pending[seq.seq_id] = seq.num_tokens - seq.num_computed_tokens
            self.running[seq.seq_id] = seq
        else:
            self.kv.free(seq)

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_table_references(self):
        refs = [0] * self.num_blocks
        for table in self.kv.tables.values():
            assert len({b.block_id for b in table}) == len(table), "a block twice in one table"
            for b in table:
                refs[b.block_id] += 1
        assert [b.ref_cnt for b in self.kv.pool.blocks] == refs
        assert self.kv.pool.num_shared_blocks() == sum(1 for r in refs if r > 1)
        assert set(self.kv.tables) == set(self.running), "a table without a running seq, or none"

    @invariant()
    def free_queue_holds_exactly_the_unreferenced_blocks(self):
        queue = [b.block_id for b in self.kv.pool.free_queue]
        assert len(queue) == len(set(queue)) == self.kv.num_free_blocks
        assert set(queue) == {b.block_id for b in self.kv.pool.blocks if b.ref_cnt == 0}
        held = {b.block_id for t in self.kv.tables.values() for b in t}
        assert self.kv.num_free_blocks + len(held) == self.num_blocks

    @invariant()
    def every_cached_hash_maps_to_one_block_holding_its_tokens(self):
        cached = self.kv.pool.cached
        assert len({id(b) for b in cached.values()}) == len(cached)
        for hsh, b in cached.items():
            assert b.block_hash == hsh
            assert self.mem.dev[b.block_id] == self.hash_tokens[hsh], "cached block overwritten"
        for b in self.kv.pool.blocks:
            assert b.block_hash is None or cached.get(b.block_hash) is b
        if not self.caching:
            assert not cached

    @invariant()
    def blocks_about_to_be_written_are_private(self):
        for sid, n in self.pending.items():
            seq, table = self.running[sid], self.kv.tables[sid]
            start = seq.num_computed_tokens
            assert len(table) == -(-(start + n) // BS), "allocation is not lazy / too short"
            for i in range(start // BS, len(table)):
                assert table[i].ref_cnt == 1, f"block {table[i].block_id} shared while written"
                assert table[i].block_hash is None, "a cached block is being written"

    @invariant()
    def every_seq_reads_back_its_own_tokens(self):
        for sid, seq in self.running.items():
            n = seq.num_computed_tokens
            if not self.pending.get(sid):
                assert len(self.kv.tables[sid]) == -(-n // BS)
            got = KVMemory.read(self.mem.dev, self.kv.block_ids(seq), n)
            assert got == seq.all_token_ids[:n], f"seq {sid} reads foreign KV"
        for sid, seq in self.swapped.items():
            got = KVMemory.read(self.mem.cpu, self.kv.swapped[sid], seq.num_computed_tokens)
            assert got == seq.all_token_ids[: seq.num_computed_tokens]

    @invariant()
    def cpu_blocks_are_accounted_for(self):
        used = [c for cpu in self.kv.swapped.values() for c in cpu]
        assert sorted(used + self.kv.cpu_free) == list(range(self.num_cpu_blocks))
        assert set(self.kv.swapped) == set(self.swapped)

    def teardown(self):
        for seq in list(self.running.values()) + list(self.swapped.values()):
            self.kv.free(seq)
        assert self.kv.num_free_blocks == self.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert len(self.kv.cpu_free) == self.num_cpu_blocks
        assert not self.kv.tables and not self.kv.swapped


class KVCacheMachineNoCaching(KVCacheMachine):
    caching = False


_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestKVCacheManagerStateful = KVCacheMachine.TestCase
TestKVCacheManagerStateful.settings = _SETTINGS
TestKVCacheManagerStatefulNoCaching = KVCacheMachineNoCaching.TestCase
TestKVCacheManagerStatefulNoCaching.settings = settings(_SETTINGS, max_examples=60)
