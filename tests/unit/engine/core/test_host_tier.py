"""The KV host tier: HostTier's LRU and pins against a reference model, and the KVCacheManager
with a host tier driven by the block-manager state machine, with simulated device and host memory,
so a block offloaded or restored wrongly shows up as a sequence reading tokens not its own."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.engine.core.kv_cache_manager import HostHit, KVCacheManager
from kvserve.engine.core.kv_events import KVEvent
from kvserve.engine.kv_offload.host_tier import HostTier

from test_kv_cache_manager import _SETTINGS, BS, KVCacheMachine, KVMemory, make_seq, prefill


def h(i: int) -> bytes:
    return bytes([i]) * 16


def test_store_once_then_lru_eviction_skips_pinned_slots():
    tier = HostTier(2)
    a, _ = tier.store(h(1))
    b, _ = tier.store(h(2))
    assert {a, b} == {0, 1}
    assert tier.store(h(1)) == (None, None)  # already here: no copy, made most recent
    assert tier.lru_hashes() == [h(2), h(1)]
    assert tier.store(h(3)) == (None, None)  # both slots pinned by this step's copies
    tier.unpin_all()
    slot, victim = tier.store(h(3))
    assert victim == (h(2), b) and slot == b  # the least recently used goes
    assert tier.restore(h(1)) == a and tier.lru_hashes() == [h(3), h(1)]
    assert (tier.counters.stored, tier.counters.restored, tier.counters.evicted) == (3, 1, 1)
    assert tier.drain_events() == [KVEvent("stored", (h(1).hex(), h(2).hex()), "host"),
                                   KVEvent("removed", (h(2).hex(),), "host"),
                                   KVEvent("stored", (h(3).hex(),), "host")]
    with pytest.raises(ValueError):
        HostTier(0)


class HostTierMachine(RuleBasedStateMachine):
    """HostTier against a list kept in LRU order by hand."""

    capacity = 3

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(self.capacity)
        self.model: list[bytes] = []  # least recently used first
        self.pinned: set[bytes] = set()

    @rule(i=st.integers(0, 6))
    def store(self, i):
        key = h(i)
        slot, victim = self.tier.store(key)
        if key in self.model:
            assert (slot, victim) == (None, None), "a block already held is copied again"
            self.model.remove(key)
            self.model.append(key)
            return
        if len(self.model) == self.capacity:
            unpinned = [k for k in self.model if k not in self.pinned]
            if not unpinned:
                assert (slot, victim) == (None, None)
                return
            assert victim is not None and victim[0] == unpinned[0] and victim[1] == slot
            self.model.remove(unpinned[0])
        else:
            assert victim is None
        assert slot is not None
        self.model.append(key)
        self.pinned.add(key)

    @precondition(lambda self: bool(self.model))
    @rule(k=st.integers(0, 99))
    def restore(self, k):
        key = self.model[k % len(self.model)]
        assert self.tier.slots[key] == self.tier.restore(key)
        self.model.remove(key)
        self.model.append(key)
        self.pinned.add(key)

    @rule()
    def end_step(self):
        self.tier.unpin_all()
        self.pinned.clear()

    @invariant()
    def lru_order_and_slots_match(self):
        assert self.tier.lru_hashes() == self.model
        slots = list(self.tier.slots.values())
        assert len(slots) == len(set(slots)) <= self.capacity, "a slot holds two blocks"
        assert sorted(slots + self.tier.free) == list(range(self.capacity)), "a slot was lost"


TestHostTierLRU = HostTierMachine.TestCase
TestHostTierLRU.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


class TierMemory(KVMemory):
    """KVMemory plus host slots; applies the manager's offloads and restores, in the runner's
    order (offloads first), before the copies and swap-ins that follow an allocation."""

    def __init__(self, kv: KVCacheManager, num_blocks: int, num_cpu: int, num_host: int) -> None:
        super().__init__(num_blocks, num_cpu)
        self.kv = kv
        self.host: list[list[int | None]] = [[None] * BS for _ in range(num_host)]
        self.num_restored = 0

    def apply_tier_moves(self) -> None:
        offloads, restores = self.kv.take_tier_moves()
        for d, s in offloads:
            self.host[s] = list(self.dev[d])
        for s, d in restores:
            self.dev[d] = list(self.host[s])
        self.num_restored += len(restores)

    def copy(self, pairs):
        self.apply_tier_moves()
        super().copy(pairs)

    def swap_in(self, pairs):
        self.apply_tier_moves()
        super().swap_in(pairs)


class KVCacheTierMachine(KVCacheMachine):
    """The block-manager machine with a device pool too small for its prefixes and a host tier
    behind it: every invariant of the device side, plus the host tier's."""

    num_blocks = 10
    num_cpu_blocks = 4
    num_host_blocks = 8

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.num_blocks, BS, True, self.num_cpu_blocks,
                                 self.num_host_blocks)
        self.mem = TierMemory(self.kv, self.num_blocks, self.num_cpu_blocks,
                              self.num_host_blocks)
        self.prompts: set[tuple[tuple[int, ...], str | None]] = set()

    @rule(tok=st.integers(4, 6))
    def flush_device_cache(self, tok):
        """A request that takes every free block (so the device cache is evicted to the host
        tier) and is aborted: the next admissions of the shared prefixes hit the host."""
        n = self.kv.num_free_blocks * BS
        if n == 0:
            return
        seq = make_seq(self._new_id(), [tok + (i // BS) % 2 for i in range(n)])
        self._record_hashes(seq)
        if self._allocate(seq, n):  # aborted before its blocks were registered: not cached
            self.mem.write(self.kv.block_ids(seq), seq.all_token_ids, 0, n)
        self.kv.free(seq)

    @precondition(lambda self: len(self.kv.host) > 0)
    @rule(k=st.integers(0, 99), extra=st.lists(st.integers(1, 3), max_size=3),
          chunk=st.integers(1, 16))
    def admit_a_prefix_the_host_holds(self, k, extra, chunk):
        """A new request repeating an earlier one's tokens whose blocks the host tier holds."""
        cands = []
        for tokens, salt in self.prompts:
            probe = make_seq(self._new_id(), list(tokens), salt)
            if any(isinstance(x, HostHit) for x in self.kv.lookup_prefix(probe)):
                cands.append((tokens, salt))
            self.kv.free(probe)
        if not cands:
            return
        tokens, salt = cands[k % len(cands)]
        seq = make_seq(self._new_id(), list(tokens) + extra, salt)
        self._record_hashes(seq)
        hits = self.kv.lookup_prefix(seq)
        cached = len(hits) * BS
        if not self._allocate(seq, min(seq.num_tokens - cached, chunk), hits):
            self.kv.free(seq)
            return
        got = KVMemory.read(self.mem.dev, self.kv.block_ids(seq), cached)
        # the hits may run into `extra` (an earlier seq decoded those tokens into a full block)
        assert got == seq.all_token_ids[:cached], "a restore brought back foreign KV"
        seq.num_computed_tokens = cached
        self.pending[seq.seq_id] = min(seq.num_tokens - cached, chunk)
        self.running[seq.seq_id] = seq

    def _record_hashes(self, seq):
        super()._record_hashes(seq)
        self.prompts.add((tuple(seq.prompt_token_ids), seq.cache_salt))

    @invariant()
    def host_tier_holds_each_block_once_within_its_bounds(self):
        host = self.kv.host
        slots = list(host.slots.values())
        assert len(slots) == len(set(slots)) <= self.num_host_blocks
        assert sorted(slots + host.free) == list(range(self.num_host_blocks))
        assert not host.pinned and not self.kv.pending_restores and not self.kv.pending_offloads

    @invariant()
    def every_host_block_holds_the_tokens_of_its_hash(self):
        for hsh, slot in self.kv.host.slots.items():
            assert self.mem.host[slot] == self.hash_tokens[hsh], "host block holds foreign KV"


TestKVCacheTierStateful = KVCacheTierMachine.TestCase
TestKVCacheTierStateful.settings = _SETTINGS


def test_an_evicted_prefix_is_restored_from_the_host_tier_and_counted():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    mem = TierMemory(kv, 4, 0, 8)
    a = make_seq(1, list(range(1, 14)))  # 3 full blocks + 1 token
    prefill(kv, a)
    mem.write(kv.block_ids(a), a.all_token_ids, 0, a.num_tokens)
    kv.free(a)
    b = make_seq(2, [9] * 13)  # takes every block: a's cached blocks are evicted to the host
    prefill(kv, b)
    mem.apply_tier_moves()
    mem.write(kv.block_ids(b), b.all_token_ids, 0, b.num_tokens)
    assert len(kv.host) == 3 and not kv.pool.cached.keys() & set(kv.host.slots)
    kv.free(b)
    c = make_seq(3, list(range(1, 14)) + [7])
    hits = kv.lookup_prefix(c)
    assert [type(x) for x in hits] == [HostHit] * 3
    assert kv.allocate_slots(c, c.num_tokens - 12, hits)
    mem.apply_tier_moves()
    assert mem.num_restored == 3
    assert KVMemory.read(mem.dev, kv.block_ids(c), 12) == c.all_token_ids[:12]
    kv.record_lookup(c.num_tokens, 12, 12)
    stats = kv.make_stats()
    assert (stats.prefix_cache_hits, stats.prefix_cache_host_hits) == (12, 12)
    assert (stats.host.stored, stats.host.restored) == (6, 3)  # a's 3, then b's 3 for c
    # Restored blocks are device-cached again: the next lookup hits the device, copies nothing.
    d = make_seq(4, list(range(1, 14)) + [8])
    assert all(not isinstance(x, HostHit) for x in kv.lookup_prefix(d))


def test_a_failed_allocation_with_host_hits_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_host_blocks=4)
    a = make_seq(1, list(range(1, 10)))
    prefill(kv, a)
    kv.free(a)
    prefill(kv, make_seq(2, [9] * 9))  # evicts a's 2 blocks to the host, holds all 3 blocks
    kv.take_tier_moves()
    c = make_seq(3, list(range(1, 10)))
    hits = kv.lookup_prefix(c)
    assert len(hits) == 2
    before = (kv.host.lru_hashes(), dict(kv.host.slots), kv.num_free_blocks)
    assert not kv.allocate_slots(c, 1, hits)
    assert (kv.host.lru_hashes(), dict(kv.host.slots), kv.num_free_blocks) == before
    assert kv.take_tier_moves() == ([], [])


def test_a_cleared_tier_hands_out_every_slot_once_again():
    """Found by the mutation run (docs/mutation.md): the free list rebuilt by clear()."""
    tier = HostTier(3)
    for i in range(3):
        tier.store(h(i))
    tier.unpin_all()
    tier.clear()
    stored = [tier.store(h(10 + i)) for i in range(3)]
    assert sorted(slot for slot, _ in stored) == [0, 1, 2]
    assert [victim for _, victim in stored] == [None, None, None]  # room without evicting
    assert tier.usage() == 1.0
    assert tier.drain_events() == [
        KVEvent("cleared", medium="host"),
        KVEvent("stored", tuple(h(10 + i).hex() for i in range(3)), "host")]
    tier.unpin_all()
    assert tier.store(h(20))[1] is not None  # and no slot beyond the three: the fourth evicts
    tier.clear()
    tier.store(h(30))
    assert tier.usage() == 1 / 3


def test_a_one_block_tier_is_allowed():
    tier = HostTier(1)
    assert tier.store(h(1)) == (0, None)
    tier.unpin_all()
    assert tier.store(h(2)) == (0, (h(1), 0))  # the one slot, reused for the newer block
