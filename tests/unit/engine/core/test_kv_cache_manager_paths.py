"""KVCacheManager paths the tests of test_kv_cache_manager.py leave open (mutation survivors,
see docs/mutation.md): a CPU pool that exactly fits a swap-out, and the tier figures of a
manager without tiers."""

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
