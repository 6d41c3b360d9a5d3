"""KVCacheManager paths the tests of test_kv_cache_manager.py leave open (mutation survivors,
see docs/mutation.md): a CPU pool that exactly fits a swap-out, the tier figures of a
manager without tiers, the blocks a swap-in adds (or does not), the hash of a block not yet
full, and a fork made before the first full block."""

from __future__ import annotations

from test_kv_cache_manager import BS, make_seq, prefill

from kvserve.engine.core.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_offload.host_tier import TierCounters


def test_a_cpu_pool_of_exactly_the_seqs_blocks_takes_its_swap_out():
    kv = KVCacheManager(num_blocks=6, block_size=BS, num_cpu_blocks=3)
    seq = make_seq(1, [2] * 10)  # 3 blocks
    prefill(kv, seq)
    assert kv.can_swap_out(seq)
    assert len(kv.swap_out(seq)) == 3 and kv.cpu_free == []
    bigger = make_seq(2, [3] * 13)  # 4 blocks, 3 CPU blocks
    prefill(kv, bigger)
    assert not kv.can_swap_out(bigger)


def test_a_manager_without_tiers_reports_no_tier_figures():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    prefill(kv, make_seq(1, [2] * 10))
    stats = kv.make_stats()
    tiers = (stats.prefix_cache_host_hits, stats.num_host_blocks, stats.num_host_cached_blocks,
             stats.prefix_cache_disk_hits, stats.num_disk_blocks, stats.num_disk_cached_blocks,
             stats.disk_blocks_dropped, stats.disk_bad_files, stats.disk_bytes_written,
             stats.disk_bytes_read)
    assert tiers == (0,) * len(tiers)
    assert stats.host == TierCounters() and stats.disk == TierCounters()


def test_can_swap_in_adds_only_the_blocks_the_next_tokens_lack():
    kv = KVCacheManager(num_blocks=5, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [1] * 8)
    prefill(kv, seq)  # 2 full blocks
    kv.swap_out(seq)
    prefill(kv, make_seq(2, [2] * 5))  # 2 blocks: 3 left
    seq.output_token_ids.append(3)
    assert kv.can_swap_in(seq, 1)  # its 2 blocks and 1 for its next token: exactly 3


def test_a_swapped_seqs_blocks_count_when_its_next_tokens_need_fewer():
    # Slots for 8 tokens were allocated, none computed (a seq preempted in the step that
    # allocated them): its next token needs 1 block, but both of its blocks come back.
    kv = KVCacheManager(num_blocks=3, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [1] * 8)
    assert kv.allocate_slots(seq, 8)
    kv.swap_out(seq)
    prefill(kv, make_seq(2, [2] * 5))  # 2 blocks: 1 left
    assert not kv.can_swap_in(seq, 1)


def test_a_blocks_hash_asked_before_it_is_full_is_not_kept():
    # The scheduler asks for the hash of a waiting prompt's next block, which may be partial
    # (6 tokens: block 1 holds 2). None is given; once block 1 fills it is cached under the hash
    # of its 4 tokens, so a prompt with those 8 tokens hits both blocks.
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_seq(1, list(range(1, 7)))
    assert kv.full_block_hashes(a, 1, 2) == []
    prefill(kv, a)
    a.output_token_ids += [7, 8]
    assert kv.allocate_slots(a, 2)
    a.num_computed_tokens = 8
    kv.register_computed(a)
    b = make_seq(2, list(range(1, 10)))
    assert len(kv.lookup_prefix(b)) == 2


def test_a_swapped_seq_whose_next_token_fits_its_last_block_needs_only_its_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_cpu_blocks=4)
    seq = make_seq(1, [1] * 6)
    prefill(kv, seq)  # 2 blocks, the second with 2 free slots
    kv.swap_out(seq)
    prefill(kv, make_seq(2, [2] * 5))  # 2 blocks: 2 left
    seq.output_token_ids.append(3)
    assert kv.can_swap_in(seq, 1)  # token 7 goes into its own second block
    kv.swap_in(seq)
    assert kv.allocate_slots(seq, 1) and kv.num_free_blocks == 0


def test_a_fork_before_the_first_full_block_caches_its_own_first_block():
    # The parent's 2-token prompt fills no block, so nothing of it is registered. The child
    # writes its own tokens into a private copy of block 0 and, once full, caches it.
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make_seq(1, [1, 2])
    prefill(kv, parent)
    child = make_seq(2, [1, 2])
    child.num_computed_tokens = 2
    kv.fork(parent, child)
    child.output_token_ids += [7, 8]
    assert kv.allocate_slots(child, 2) and kv.take_pending_copies()  # copy-on-write of block 0
    child.num_computed_tokens = 4
    kv.register_computed(child)
    assert len(kv.lookup_prefix(make_seq(3, [1, 2, 7, 8, 9]))) == 1
