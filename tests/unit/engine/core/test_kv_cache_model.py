"""The KV-cache manager (block pool, LRU free queue, prefix cache, swap, host tier) against a
naive allocator of plain lists and dicts over random request traces (hypothesis, stateful),
speculative decoding's rollback of rejected draft slots included.

After every step: the two agree on every block table, the free order, the cached hashes, the host
tier's LRU order and each prompt's cached prefix length; and the real pool's own invariants hold
(no block both free and held, reference counts equal holders, hashes unique, counters true)."""

from __future__ import annotations

import itertools
from collections import OrderedDict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvserve.engine.core.block_hash import hash_block
from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.engine.core.sequence import Sequence

BS = 4  # tokens a block
NUM_BLOCKS, HOST_BLOCKS, CPU_BLOCKS = 12, 3, 6
# Prompts that share prefixes of 0-3 blocks with each other (tenants' system prompts, turns).
_BASE = [list(range(1, 13)), [50 + i for i in range(12)]]
PROMPTS = [_BASE[0][:k] + [100 + 10 * i + j for j in range(n)]
           for i, (k, n) in enumerate([(12, 3), (8, 6), (4, 2), (12, 7), (0, 9)])] + \
          [_BASE[1] + [7, 7], _BASE[1][:6]]


class Naive:
    """The same allocator as the simplest lists can state it: free blocks in a list (index 0
    reused first), cached hashes in a dict, the host tier as an ordered dict with pins."""

    def __init__(self) -> None:
        self.free = list(range(NUM_BLOCKS))
        self.ref = [0] * NUM_BLOCKS
        self.hash: list[bytes | None] = [None] * NUM_BLOCKS
        self.cached: dict[bytes, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.registered: dict[int, int] = {}
        self.swapped: dict[int, int] = {}  # seq -> blocks in the CPU pool
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.pinned: set[bytes] = set()

    def new_blocks(self, n: int) -> list[int]:
        out, evicted = self.free[:n], []
        del self.free[:n]
        for b in out:
            h = self.hash[b]
            if h is not None and self.cached.get(h) == b:
                del self.cached[h]
                evicted.append(h)
            self.hash[b], self.ref[b] = None, 1
        for h in evicted:  # demoted to host, LRU host blocks (not pinned this step) make room
            if h in self.host:
                self.host.move_to_end(h)
                continue
            if len(self.host) == HOST_BLOCKS:
                victim = next((v for v in self.host if v not in self.pinned), None)
                if victim is None:
                    continue
                del self.host[victim]
            self.host[h] = None
            self.pinned.add(h)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash[b] is None:
                    self.free.insert(0, b)  # nothing reusable: reused first
                else:
                    self.free.append(b)  # cached: kept longest

    def cache(self, b: int, h: bytes) -> None:
        if self.hash[b] is None and h not in self.cached:
            self.hash[b], self.cached[h] = h, b

    def hits(self, hashes: list[bytes]) -> list[bytes]:
        out = []
        for h in hashes:
            if h not in self.cached and h not in self.host:
                break
            out.append(h)
        return out


def chain(tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    for i in range(len(tokens) // BS):
        out.append(hash_block(out[-1] if out else None, tokens[i * BS:(i + 1) * BS], None))
    return out


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, num_cpu_blocks=CPU_BLOCKS,
                                 num_host_blocks=HOST_BLOCKS)
        self.n = Naive()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.ids = itertools.count()

    # ---- the naive model's side of each step --------------------------------------------------
    def _naive_allocate(self, seq: Sequence, hits: list[bytes], new_tokens: int) -> bool:
        n, sid = self.n, seq.seq_id
        table = n.tables.get(sid, [])
        start = seq.num_computed_tokens + len(hits) * BS
        new = max(-(-(start + new_tokens) // BS) - len(table) - len(hits), 0)
        on_device = [n.cached[h] for h in hits if h in n.cached]
        free_hits = sum(1 for b in on_device if n.ref[b] == 0)
        restores = len(hits) - len(on_device)
        if new + restores > len(n.free) - free_hits:
            return False
        for b in on_device:  # a device hit: one more holder, out of the free list
            if n.ref[b] == 0:
                n.free.remove(b)
            n.ref[b] += 1
        for h in hits:
            if h not in n.cached:
                n.pinned.add(h)
                n.host.move_to_end(h)
        fresh = iter(n.new_blocks(restores))
        for h in hits:
            if h in n.cached and n.cached[h] in on_device:
                table = table + [n.cached[h]]
            else:
                b = next(fresh)
                n.cache(b, h)
                table = table + [b]
        if hits:
            n.registered[sid] = len(table)
        n.tables[sid] = table + n.new_blocks(new)
        return True

    def _naive_register(self, seq: Sequence) -> None:
        n, sid = self.n, seq.seq_id
        full = seq.num_computed_tokens // BS
        hs = chain(seq.all_token_ids)
        for i in range(n.registered.get(sid, 0), full):
            n.cache(n.tables[sid][i], hs[i])
        n.registered[sid] = max(full, n.registered.get(sid, 0))

    def _end_step(self) -> None:
        self.kv.take_tier_moves()  # the runner's copies: the host tier's pins end with the step
        self.n.pinned.clear()

    # ---- a trace: admissions, decodes, finishes, swaps ----------------------------------------
    @rule(p=st.sampled_from(range(len(PROMPTS))))
    def admit(self, p: int) -> None:
        seq = Sequence(next(self.ids), "r", 0, list(PROMPTS[p]), SamplingParams())
        hits = self.kv.lookup_prefix(seq)
        assert [h.block_hash for h in hits] == self.n.hits(chain(PROMPTS[p])[:(len(PROMPTS[p])
                                                                              - 1) // BS])
        expected = self._naive_allocate(seq, [h.block_hash for h in hits],
                                        seq.num_tokens - len(hits) * BS)
        assert self.kv.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits) == expected
        if expected:
            seq.num_computed_tokens = seq.num_tokens
            self.kv.register_computed(seq)
            self._naive_register(seq)
            self.running.append(seq)
        else:
            self.kv.free(seq)
        self._end_step()

    @rule(k=st.integers(0, 7), n=st.integers(1, 5))
    def decode(self, k: int, n: int) -> None:
        if not self.running:
            return
        seq = self.running[k % len(self.running)]
        ok = self._naive_allocate(seq, [], n)
        assert self.kv.allocate_slots(seq, n) == ok
        if ok:
            seq.output_token_ids.extend(range(200 + seq.num_tokens, 200 + seq.num_tokens + n))
            seq.num_computed_tokens = seq.num_tokens
            self.kv.register_computed(seq)
            self._naive_register(seq)
        self._end_step()

    @rule(k=st.integers(0, 7), d=st.integers(1, 6), a=st.integers(0, 6))
    def speculate(self, k: int, d: int, a: int) -> None:
        """Speculative decoding: slots for a token and d drafts, a <= d of them kept, the
        rejected drafts' slots given back (KVCacheManager.trim)."""
        if not self.running:
            return
        seq, a = self.running[k % len(self.running)], min(a, d)
        ok = self._naive_allocate(seq, [], 1 + d)
        assert self.kv.allocate_slots(seq, 1 + d) == ok
        if ok:
            seq.output_token_ids.extend(range(300 + seq.num_tokens, 301 + seq.num_tokens + a))
            seq.num_computed_tokens = seq.num_tokens
            self.kv.trim(seq, seq.num_computed_tokens)
            table = self.n.tables[seq.seq_id]
            keep = -(-seq.num_computed_tokens // BS)
            self.n.release(list(reversed(table[keep:])))
            del table[keep:]
            self.kv.register_computed(seq)
            self._naive_register(seq)
        self._end_step()

    @rule(k=st.integers(0, 7))
    def finish(self, k: int) -> None:
        if not self.running:
            return
        seq = self.running.pop(k % len(self.running))
        self.kv.free(seq)
        self.n.release(list(reversed(self.n.tables.pop(seq.seq_id))))
        self.n.registered.pop(seq.seq_id, None)

    @rule(k=st.integers(0, 7))
    def swap_out(self, k: int) -> None:
        if not self.running:
            return
        seq = self.running[k % len(self.running)]
        free_cpu = CPU_BLOCKS - sum(self.n.swapped.values())
        assert self.kv.can_swap_out(seq) == (len(self.n.tables[seq.seq_id]) <= free_cpu)
        if not self.kv.can_swap_out(seq):
            return
        pairs = self.kv.swap_out(seq)
        table = self.n.tables.pop(seq.seq_id)
        assert [d for d, _ in pairs] == table
        self.n.swapped[seq.seq_id] = len(table)
        self.n.release(list(reversed(table)))
        self.n.registered[seq.seq_id] = 0
        self.running.remove(seq)
        self.swapped.append(seq)

    @rule(k=st.integers(0, 7))
    def swap_in(self, k: int) -> None:
        if not self.swapped:
            return
        seq = self.swapped[k % len(self.swapped)]
        fits = self.n.swapped[seq.seq_id] <= len(self.n.free)
        assert self.kv.can_swap_in(seq) == fits
        if not fits:
            return
        self.kv.swap_in(seq)
        self.n.tables[seq.seq_id] = self.n.new_blocks(self.n.swapped.pop(seq.seq_id))
        self.swapped.remove(seq)
        self.running.append(seq)
        self._end_step()

    # ---- checked after every step -------------------------------------------------------------
    @invariant()
    def agrees_with_the_naive_allocator(self) -> None:
        kv, n = self.kv, self.n
        for seq in self.running:
            assert kv.block_ids(seq) == n.tables[seq.seq_id]
        assert [b.block_id for b in kv.pool.free_queue] == n.free
        assert {h: b.block_id for h, b in kv.pool.cached.items()} == n.cached
        assert kv.host.lru_hashes() == list(n.host)
        for p in PROMPTS:
            probe = Sequence(-1, "probe", 0, list(p), SamplingParams())
            assert len(kv.lookup_prefix(probe)) == len(n.hits(chain(p)[:(len(p) - 1) // BS]))
            kv.hashes.pop(-1, None)

    @invariant()
    def the_pool_is_consistent(self) -> None:
        pool = self.kv.pool
        free = [b.block_id for b in pool.free_queue]
        holders = [b.block_id for t in self.kv.tables.values() for b in t]
        assert len(free) == len(set(free)) == pool.num_free_blocks
        for b in pool.blocks:
            assert b.ref_cnt == holders.count(b.block_id)
            assert (b.block_id in free) == (b.ref_cnt == 0)  # never both free and held
        assert len(set(pool.cached)) == len({b.block_id for b in pool.cached.values()})
        assert all(b.block_hash == h for h, b in pool.cached.items())
        assert pool.num_shared_blocks() == sum(1 for b in pool.blocks if b.ref_cnt > 1)
        assert len(self.kv.cpu_free) + sum(len(c) for c in self.kv.swapped.values()) == \
            CPU_BLOCKS


def test_the_kv_cache_manager_agrees_with_a_naive_allocator():
    run_state_machine_as_test(KVMachine, settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
