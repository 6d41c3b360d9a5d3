"""KV-cache groups: layers grouped by attention type, one block table per group, sliding groups
releasing the blocks that left their window; prefix hits, fork, swap and the host tier across
groups, and a randomized run that checks the pool's invariants and every seq's KV contents."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvserve.engine.core.kv_cache_groups import KVCacheGroup, KVCacheGroups, group_key
from kvserve.engine.core.kv_cache_manager import DiskHit, HostHit, KVCacheManager, PrefixMatch
from kvserve.engine.core.sequence import Sequence
from kvserve.engine.kv_offload.disk_block_file import HEADER_SIZE as FILE_HEADER
from kvserve.engine.kv_offload.disk_tier import DiskTier
from kvserve.engine.sample.sampling_params import SamplingParams

BS = 4
WINDOW = 7  # a token sees itself and the 6 before it: blocks of 4 leave the window
# Gemma 3's pattern in miniature: 1 full-attention layer per 5 sliding ones.
GEMMA3 = (7, 7, 7, 7, 7, None)


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), SamplingParams(max_tokens=10**6))


def manager(num_blocks: int, windows=GEMMA3, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=KVCacheGroups.from_windows(windows), **kw)


def no_release(groups: KVCacheGroups) -> KVCacheGroups:
    """The same groups and pages with every window off: the baseline that keeps all blocks."""
    return KVCacheGroups(tuple(KVCacheGroup(g.layers) for g in groups.groups), groups.page_layers)


def compute(kv: KVCacheManager, seq: Sequence, n: int) -> None:
    """Schedule and 'run' n tokens of seq (all its tokens must already be known)."""
    assert kv.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    kv.register_computed(seq)


def test_layers_group_by_attention_type():
    g = KVCacheGroups.from_windows(GEMMA3 * 2)  # 10 sliding, 2 full: pages of 2 layers
    assert g.page_layers == 2 and g.groups[0] == KVCacheGroup((5, 11), None)
    assert [grp.layers for grp in g.groups[1:]] == [(0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert g.slots[11] == (0, 1) and g.slots[6] == (3, 1) and g.is_hybrid
    alternating = KVCacheGroups.from_windows((128, None) * 4)  # gpt-oss: sliding on even layers
    assert alternating.page_layers == 4 and len(alternating.groups) == 2
    assert KVCacheGroups.from_windows((None,) * 3) == KVCacheGroups.single(3)
    assert KVCacheGroups.from_windows((9,) * 3) == KVCacheGroups.single(3, 9)


def test_sliding_groups_release_blocks_out_of_the_window():
    def peak_held(groups: KVCacheGroups) -> tuple[int, list[bool]]:
        kv = KVCacheManager(400, BS, groups=groups)
        seq = make_seq(1, list(range(1, 13)))
        compute(kv, seq, 12)  # the prompt in one step: every token written, then released
        peak = 0
        for t in range(60):  # a long decode
            seq.output_token_ids.append(100 + t)
            compute(kv, seq, 1)
            peak = max(peak, kv.pool.num_blocks - kv.num_free_blocks)
        return peak, [b is None for b in kv.group_tables[seq.seq_id][0]]

    groups = KVCacheGroups.from_windows(GEMMA3)
    with_window, released = peak_held(groups)
    without, _ = peak_held(no_release(groups))
    assert without == 6 * 18  # 72 tokens in 18 blocks, in each of the 6 groups
    # The full group keeps its 18; each sliding group keeps the window (6 tokens back from the
    # next one) plus the block being written: at most 3 blocks of 4.
    assert with_window == 18 + 5 * 3
    assert groups.blocks_for(72, BS, chunk=12) == 18 + 5 * 6 >= with_window  # the engine's check
    assert released == [True] * 16 + [False] * 2  # the last token, 71, sees 65..71


def test_more_requests_fit_in_the_same_blocks():
    def admitted(groups: KVCacheGroups) -> int:
        kv = KVCacheManager(120, BS, groups=groups)
        n = 0
        while True:
            seq = make_seq(n, list(range(n * 100, n * 100 + 24)))
            if not kv.allocate_slots(seq, 8):  # chunked prefill: 8 tokens a step
                return n
            seq.num_computed_tokens = 8
            for _ in range(2):
                if not kv.allocate_slots(seq, 8):
                    kv.free(seq)
                    return n
                seq.num_computed_tokens += 8
            n += 1

    groups = KVCacheGroups.from_windows(GEMMA3)
    assert admitted(no_release(groups)) == 120 // 36  # 6 blocks of 24 tokens in 6 groups
    # With the windows: 6 full + 5 x 4 sliding (the chunk of 8 and the 6 tokens before it).
    assert admitted(groups) == 120 // 26


def test_prefix_hit_needs_only_the_window_blocks_of_sliding_groups():
    kv = manager(200)
    tokens = list(range(1, 42))
    a = make_seq(1, tokens)
    for _ in range(5):  # chunked: the sliding groups release as it goes
        compute(kv, a, 8)
    kv.free(a)  # every full block stays cached, free (LRU)
    b = make_seq(2, tokens + [99])
    hits = kv.lookup_prefix(b)
    assert isinstance(hits, PrefixMatch) and len(hits) == 10  # 40 tokens, block 10 is partial
    # A sliding group resumes at 40 with keys 34..39: blocks 8 and 9; the others stay None.
    assert all(g[:8] == [None] * 8 and None not in g[8:] for g in hits.groups[1:])
    assert None not in hits.groups[0]
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, b.num_tokens - 40, hits)
    assert kv.num_free_blocks == free_before - 10 - 5 * 2 - 6  # hits taken + 1 new per group
    assert kv.block_ids(b, 3)[:8] == [0] * 8


def test_a_sliding_group_missing_its_window_lowers_the_hit():
    kv = manager(200)
    tokens = list(range(1, 42))
    a = make_seq(1, tokens)
    compute(kv, a, 40)
    kv.free(a)
    b = make_seq(2, tokens)
    # Evict block 9 of one sliding group only: that group can resume at 8 at best (its blocks
    # 6, 7 are there) and every group must agree on one boundary.
    key = group_key(kv.full_block_hashes(b, 9, 10)[0], 2)
    victim = kv.pool.get_cached_block(key)
    kv.pool.free_queue.remove(victim)
    kv.pool.free_queue.appendleft(victim)
    kv.pool.get_new_blocks(1)
    hits = kv.lookup_prefix(b)
    assert len(hits) == 9 and all(len(g) == 9 for g in hits.groups)


def test_host_tier_restores_every_groups_blocks():
    kv = manager(40, num_host_blocks=64)
    tokens = list(range(1, 22))
    a = make_seq(1, tokens)
    compute(kv, a, 20)
    kv.free(a)
    kv.take_tier_moves()
    filler = make_seq(2, list(range(500, 560)))  # evicts a's cached blocks to the host tier
    assert kv.allocate_slots(filler, 24)
    offloads, _ = kv.take_tier_moves()
    assert offloads
    kv.free(filler)
    hits = kv.lookup_prefix(make_seq(3, tokens))
    assert len(hits) == 5 and any(isinstance(h, HostHit) for g in hits.groups for h in g)


# ---- randomized run ---------------------------------------------------------------------------
class Memory:
    """What each page holds, per token slot, as the runner's copies would leave it."""

    def __init__(self) -> None:
        self.dev: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def write(self, kv: KVCacheManager, seq: Sequence, start: int, n: int) -> None:
        for g in range(len(kv.groups.groups)):
            ids = kv.block_ids(seq, g)
            for p in range(start, start + n):
                page = self.dev.setdefault(ids[p // BS], [None] * BS)
                page[p % BS] = (g, seq.token_range(p, p + 1)[0], p)

    def apply(self, kv: KVCacheManager, swap_out=(), swap_in=()) -> None:
        copy = lambda src, s, dst, d: dst.__setitem__(d, list(src.get(s, [None] * BS)))  # noqa
        offloads, restores = kv.take_tier_moves()
        for d, h in offloads:
            copy(self.dev, d, self.host, h)
        for d, c in swap_out:
            copy(self.dev, d, self.cpu, c)
        for h, d in restores:
            copy(self.host, h, self.dev, d)
        for c, d in swap_in:
            copy(self.cpu, c, self.dev, d)
        for s, d in kv.take_pending_copies():
            copy(self.dev, s, self.dev, d)


def check_invariants(kv: KVCacheManager, mem: Memory, seqs: list[Sequence]) -> None:
    pool = kv.pool
    free = {b.block_id for b in pool.free_queue}
    holders = Counter(b.block_id for t in list(kv.tables.values()) +
                      [t for ts in kv.group_tables.values() for t in ts] for b in t if b)
    assert not free & set(holders), "a block is both free and held"
    for b in pool.blocks:
        assert b.ref_cnt == holders[b.block_id], f"block {b.block_id} ref count != holders"
    assert len(free) == pool.num_free_blocks == pool.num_blocks - len(holders)
    for seq in seqs:  # what every group's layers will read holds this seq's own tokens
        c = seq.num_computed_tokens
        for g, group in enumerate(kv.groups.groups):
            ids = kv.block_ids(seq, g)
            w = group.sliding_window  # the next token, at c, sees keys c - w + 1 .. c
            lo = max(0, c - w + 1) if w else 0
            for p in range(lo, c):
                assert mem.dev[ids[p // BS]][p % BS] == (g, seq.token_range(p, p + 1)[0], p)


NUM_BLOCKS, SEED = 40, 3


def test_randomized_groups_keep_the_pool_consistent_and_the_contents_right():
    rng = random.Random(SEED)
    for windows in (GEMMA3, (5, None), (6,)):
        kv = manager(NUM_BLOCKS, windows, num_cpu_blocks=40, num_host_blocks=30)
        mem, running, swapped, next_id = Memory(), [], [], 0
        seen: Counter = Counter()  # what the run exercised
        bases = [[rng.randint(1, 3) for _ in range(30)] for _ in range(2)]
        for _ in range(400):
            op = rng.random()
            if op < 0.35 and len(running) < 6:
                next_id += 1
                toks = bases[rng.randrange(2)][:rng.randint(0, 30)] + [rng.randint(1, 9)]
                seq = make_seq(next_id, toks)
                hits = kv.lookup_prefix(seq)
                seq.num_computed_tokens = 0
                if kv.allocate_slots(seq, min(seq.num_tokens - len(hits) * BS, 9), hits):
                    seen["restore"] += bool(kv.pending_restores)
                    mem.apply(kv)
                    seen["hit"] += bool(hits)
                    seq.num_computed_tokens = len(hits) * BS
                    n = min(seq.num_tokens - seq.num_computed_tokens, 9)
                    mem.write(kv, seq, seq.num_computed_tokens, n)
                    seq.num_computed_tokens += n
                    kv.register_computed(seq)
                    running.append(seq)
                else:
                    kv.free(seq)
            elif op < 0.75 and running:
                seq = rng.choice(running)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.output_token_ids.append(rng.randint(1, 9))
                n = min(seq.num_tokens - seq.num_computed_tokens, rng.randint(1, 9))
                if kv.allocate_slots(seq, n):
                    mem.apply(kv)
                    mem.write(kv, seq, seq.num_computed_tokens, n)
                    seq.num_computed_tokens += n
                    kv.register_computed(seq)
            elif op < 0.82 and running:
                seq = running.pop(rng.randrange(len(running)))
                kv.free(seq)
            elif op < 0.88 and running and kv.can_swap_out(running[-1]):
                seq = running.pop()
                mem.apply(kv, swap_out=kv.swap_out(seq))
                seen["swap"] += 1
                swapped.append(seq)
            elif op < 0.94 and swapped and kv.can_swap_in(swapped[0]):
                seq = swapped.pop(0)
                mem.apply(kv, swap_in=kv.swap_in(seq))
                kv.register_computed(seq)
                running.append(seq)
            elif op < 0.97 and running and len(running) < 6 and \
                    running[0].num_computed_tokens == running[0].num_tokens:
                parent = running[0]
                next_id += 1
                child = make_seq(next_id, parent.prompt_token_ids)
                child.output_token_ids = list(parent.output_token_ids)
                child.num_computed_tokens = parent.num_computed_tokens
                kv.fork(parent, child)
                seen["fork"] += 1
                running.append(child)
            check_invariants(kv, mem, running)
        assert min(seen[k] for k in ("restore", "hit", "swap", "fork")) > 0, seen
        for seq in running + swapped:
            kv.free(seq)
        assert kv.num_free_blocks == kv.pool.num_blocks and sorted(kv.cpu_free) == list(range(40))


def test_the_budget_counts_pages_of_page_layers():
    from kvserve.engine.sizing.memory import plan_memory
    from kvserve.engine.worker.kv_sizing import page_budget

    groups = KVCacheGroups.from_windows(GEMMA3 * 2)  # 12 layers in pages of 2
    whole = plan_memory(total_bytes=10 << 20, gpu_memory_utilization=1.0, weight_bytes=0,
                        activation_peak=0, num_layers=12, num_kv_heads=2, head_dim=16,
                        kv_dtype_bytes=2, block_size=16, tokens_per_request=64)
    paged = page_budget(whole, groups, 12, None, (64, 1))
    assert paged.bytes_per_block == whole.bytes_per_block // 6 == 2 * 2 * 2 * 16 * 2 * 16
    assert paged.num_blocks == whole.kv_bytes // paged.bytes_per_block >= 6 * whole.num_blocks
    # 64 tokens: 4 blocks in each of the 1 full group, and (W 7) 2 in each of the 5 sliding.
    assert paged.max_concurrency_windowed == paged.num_blocks // (4 + 5 * 2)
    assert page_budget(whole, KVCacheGroups.single(12), 12) == whole


def test_a_prompt_of_whole_blocks_all_cached_leaves_its_last_block_to_compute():
    # 40 tokens = 10 full blocks, all cached: the last token's logits are needed, so the hit
    # stops at 9 blocks, as with one group.
    kv = manager(200)
    tokens = list(range(1, 41))
    a = make_seq(1, tokens)
    for _ in range(5):
        compute(kv, a, 8)
    kv.free(a)
    b = make_seq(2, tokens)
    hits = kv.lookup_prefix(b)
    assert isinstance(hits, PrefixMatch) and len(hits) == 9
    assert all(len(g) == 9 for g in hits.groups)
    # A plain list of hits loses the other groups': a manager with several refuses it.
    with pytest.raises(ValueError, match="PrefixMatch"):
        kv.allocate_slots(b, b.num_tokens - 36, list(hits))
    two = manager(200, windows=(7, None))
    c = make_seq(3, tokens)
    compute(two, c, 40)
    two.free(c)
    d = make_seq(4, tokens)
    with pytest.raises(ValueError, match="PrefixMatch"):
        two.allocate_slots(d, 4, list(two.lookup_prefix(d)))


# ---- lookups the tests above leave open (mutation survivors, docs/mutation.md) -----------------

def evict(kv: KVCacheManager, key: bytes) -> None:
    """Evict the free cached block holding `key` (it is taken, as by another request)."""
    victim = kv.pool.get_cached_block(key)
    kv.pool.free_queue.remove(victim)
    kv.pool.free_queue.appendleft(victim)
    assert kv.pool.get_new_blocks(1) == [victim] and kv.pool.get_cached_block(key) is None


def test_a_model_whose_every_layer_slides_resumes_from_its_window_alone():
    # One group, all layers sliding (Mistral's pattern): block 0 evicted does not matter, since a
    # resume at 40 reads only keys 34..39 (blocks 8, 9). A full-attention lookup would stop at 0.
    kv = KVCacheManager(200, BS, groups=KVCacheGroups.single(3, WINDOW))
    tokens = list(range(1, 42))
    a = make_seq(1, tokens)
    compute(kv, a, 40)
    kv.free(a)
    b = make_seq(2, tokens + [99])
    evict(kv, kv.full_block_hashes(b, 0, 1)[0])
    hits = kv.lookup_prefix(b)
    assert len(hits) == 10 and hits.groups[0][:8] == [None] * 8 and None not in hits.groups[0][8:]
    assert kv.allocate_slots(b, 2, hits) and kv.block_ids(b)[:8] == [0] * 8


def test_two_windows_agree_on_a_boundary_each_can_resume_from():
    # Windows of 7 (2 blocks back) and 11 (3 blocks back). The 11-group lacks block 8, so it
    # can resume at 8 at best; the 7-group lacks block 7, so at 8 it cannot (it needs 6 and 7):
    # lowering the boundary for one group breaks the other, and both settle at 7.
    kv = manager(200, windows=(7, 11, 7, 11))
    tokens = list(range(1, 42))
    a = make_seq(1, tokens)
    compute(kv, a, 40)
    kv.free(a)
    b = make_seq(2, tokens)
    (g7,) = [g for g, grp in enumerate(kv.groups.groups) if grp.sliding_window == 7]
    (g11,) = [g for g, grp in enumerate(kv.groups.groups) if grp.sliding_window == 11]
    hashes = kv.full_block_hashes(b, 0, 10)
    evict(kv, group_key(hashes[8], g11))
    evict(kv, group_key(hashes[7], g7))
    hits = kv.lookup_prefix(b)
    assert len(hits) == 7
    for g, grp in enumerate(kv.groups.groups):  # each group holds its window before 7
        need = grp.window_blocks(BS)
        assert hits.groups[g][:7 - need] == [None] * (7 - need)
        assert None not in hits.groups[g][7 - need:] and len(hits.groups[g]) == 7


def test_a_hybrid_match_read_as_a_list_is_the_full_attention_groups_hits():
    # The scheduler counts a match's hits (host, disk) from the list: every block of the prefix,
    # as with one group, not a sliding group's window with None before it.
    kv = manager(200)
    tokens = list(range(1, 42))
    a = make_seq(1, tokens)
    compute(kv, a, 40)
    kv.free(a)
    hits = kv.lookup_prefix(make_seq(2, tokens))
    full = [g for g, grp in enumerate(kv.groups.groups) if grp.sliding_window is None]
    assert len(hits) == 10 and None not in hits and list(hits) == hits.groups[full[0]]


def test_disk_hits_of_every_group_carry_the_bytes_read_from_their_files(tmp_path):
    # Every group's pages of b's prefix are only on disk: the lookup reads them in one batch and
    # each hit carries its own page's bytes, which allocation queues as loads.
    disk = DiskTier(tmp_path, 400 * (FILE_HEADER + 8), 8, "groups-test")
    try:
        kv = manager(200, num_host_blocks=4, disk=disk)
        b = make_seq(2, list(range(1, 42)))
        hashes = kv.full_block_hashes(b, 0, 10)
        page = {}
        for g in range(len(kv.groups.groups)):
            for i, h in enumerate(hashes):
                page[group_key(h, g)] = bytearray([g, i] * 4)
                assert disk.put(group_key(h, g), page[group_key(h, g)], wait=True)
        disk.flush()
        hits = kv.lookup_prefix(b)
        assert len(hits) == 10
        found = [h for grp in hits.groups for h in grp if h is not None]
        assert found and all(isinstance(h, DiskHit) for h in found)
        assert all(h.payload == page[h.block_hash] for h in found)
        assert kv.allocate_slots(b, 1, hits)
        _, loads = kv.take_disk_moves()
        assert sorted(bytes(p) for p, _ in loads) == sorted(bytes(h.payload) for h in found)
    finally:
        disk.close()
