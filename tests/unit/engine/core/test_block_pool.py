"""BlockPool and FreeBlockQueue: LRU order, lazy eviction of cached blocks, reference counts,
double frees, prefix-cache events and reset."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from conftest import replay_kv_events
from hypothesis import strategies as st

from kvserve.engine.core.block_pool import Block, BlockPool, FreeBlockQueue
from kvserve.engine.core.kv_events import KVEvent


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


# ---- FreeBlockQueue -----------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["popleft", "append", "appendleft", "remove"]),
                          st.integers(0, 1000)), max_size=60))
def test_free_queue_matches_a_list_model(ops):
    blocks = [Block(i) for i in range(8)]
    q = FreeBlockQueue(blocks[:5])
    model = blocks[:5]
    outside = blocks[5:]
    for op, k in ops:
        if op == "popleft":
            if not model:
                with pytest.raises(IndexError):
                    q.popleft()
                continue
            got = q.popleft()
            assert got is model.pop(0)
            outside.append(got)
        elif op in ("append", "appendleft") and outside:
            b = outside.pop(k % len(outside))
            getattr(q, op)(b)
            model.insert(len(model) if op == "append" else 0, b)
        elif op == "remove" and model:
            b = model.pop(k % len(model))
            q.remove(b)
            outside.append(b)
        assert list(q) == model
        assert q.num_free == len(model)
        assert all(b.prev is None and b.next is None for b in outside)


def test_free_queue_remove_from_the_middle_keeps_the_order_of_the_rest():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    q.appendleft(blocks[4])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [4, 1, 3, 0]
    assert [q.popleft().block_id for _ in range(4)] == [4, 1, 3, 0]
    with pytest.raises(IndexError):
        q.popleft()


def test_free_queue_refuses_to_remove_a_block_it_does_not_hold():
    blocks = [Block(i) for i in range(3)]
    q = FreeBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="block 2 is not in the free queue"):
        q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1]


# ---- BlockPool: allocation and reference counts ----------------------------------------------

def test_fresh_pool_hands_out_blocks_in_order_with_one_reference():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    assert pool.usage() == pytest.approx(0.75)


def test_asking_for_too_many_blocks_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="only 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert [b.block_id for b in pool.get_new_blocks(1)] == [3]


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="positive"):
        BlockPool(0)


def test_shared_block_returns_to_the_free_queue_only_after_the_last_reference():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 3 and pool.num_shared_blocks() == 1
    pool.free_blocks([b])
    pool.free_blocks([b])
    assert pool.num_free_blocks == 1 and pool.num_shared_blocks() == 0
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match=f"double free of block {b.block_id}"):
        pool.free_blocks([b])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([pool.blocks[1]])  # never allocated


def test_a_free_list_with_a_double_free_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match=f"double free of block {a.block_id}"):
        pool.free_blocks([b, a, a])
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 1)
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 3


# ---- BlockPool: prefix cache and LRU eviction ------------------------------------------------

def _cached_and_freed(pool: BlockPool, n: int, first_hash: int = 0) -> list[Block]:
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(first_hash + i))
    pool.free_blocks(blocks)
    return blocks


def test_freed_cached_blocks_stay_findable_until_evicted():
    pool = BlockPool(4)
    a, b = _cached_and_freed(pool, 2)
    assert pool.num_free_blocks == 4
    assert pool.get_cached_block(h(0)) is a and pool.get_cached_block(h(1)) is b
    pool.get_new_blocks(2)  # the two never-used blocks come first
    assert pool.get_cached_block(h(0)) is a and pool.num_evictions == 0


def test_cached_blocks_are_evicted_oldest_freed_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free_blocks([blocks[1]])
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0]])
    pool.drain_events()
    order = [pool.get_new_blocks(1)[0].block_id for _ in range(3)]
    assert order == [1, 2, 0]
    assert pool.num_evictions == 3
    assert pool.drain_events() == [KVEvent("removed", (h(1).hex(), h(2).hex(), h(0).hex()))]
    assert pool.cached_hashes() == []
    assert all(b.block_hash is None for b in blocks)


def test_uncached_freed_blocks_are_reused_before_any_cached_one():
    pool = BlockPool(4)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    pool.cache_block(b0, h(0))
    pool.cache_block(b1, h(1))
    pool.free_blocks([b0])  # cached
    pool.free_blocks([b2])  # nothing reusable
    pool.free_blocks([b1])  # cached
    pool.free_blocks([b3])  # nothing reusable, freed last
    first_two = {b.block_id for b in pool.get_new_blocks(2)}
    assert first_two == {2, 3}
    assert pool.num_evictions == 0 and sorted(pool.cached_hashes()) == sorted([h(0).hex(), h(1).hex()])
    assert [b.block_id for b in pool.get_new_blocks(2)] == [0, 1]


def test_never_used_blocks_are_taken_before_cached_ones():
    pool = BlockPool(4)
    _cached_and_freed(pool, 2)  # blocks 0, 1 cached and free
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 3]
    assert pool.num_evictions == 0


def test_a_cache_hit_refreshes_the_block_in_the_lru_order():
    pool = BlockPool(2)
    a, b = _cached_and_freed(pool, 2)  # a is the oldest
    pool.touch([a])  # hit: a leaves the free queue...
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])  # ...and comes back as the most recently used
    (victim,) = pool.get_new_blocks(1)
    assert victim is b
    assert pool.get_cached_block(h(1)) is None and pool.get_cached_block(h(0)) is a


def test_touching_a_block_in_use_only_adds_a_reference():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(0))
    pool.touch([pool.get_cached_block(h(0))])
    assert a.ref_cnt == 2 and pool.num_free_blocks == 2


def test_first_writer_wins_and_the_duplicate_stays_private():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(7))
    pool.cache_block(b, h(7))
    assert pool.get_cached_block(h(7)) is a and b.block_hash is None
    assert pool.drain_events() == [KVEvent("stored", (h(7).hex(),))]
    pool.free_blocks([a, b])
    # The private duplicate is reused first and evicting it announces nothing.
    assert pool.get_new_blocks(1)[0] is b
    assert pool.drain_events() == [] and pool.num_evictions == 0


def test_a_block_is_cached_under_one_hash_only():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    pool.cache_block(a, h(2))
    assert pool.cached_hashes() == [h(1).hex()] and a.block_hash == h(1)


def test_caching_disabled_caches_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None and pool.drain_events() == []


# ---- events and reset -------------------------------------------------------------------------

def test_events_are_ordered_and_consecutive_kinds_batched():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.free_blocks([a, b])
    c, d = pool.get_new_blocks(2)  # evicts h1 then h2
    pool.cache_block(c, h(3))
    events = pool.drain_events()
    assert events == [KVEvent("stored", (h(1).hex(), h(2).hex())),
                      KVEvent("removed", (h(1).hex(), h(2).hex())),
                      KVEvent("stored", (h(3).hex(),))]
    assert pool.drain_events() == []
    assert replay_kv_events(events) == set(pool.cached_hashes()) == {h(3).hex()}


def test_the_same_hash_stored_again_after_eviction_is_announced_again():
    pool = BlockPool(1)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    pool.free_blocks([a])
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(1))
    assert [e.kind for e in pool.drain_events()] == ["stored", "removed", "stored"]


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(1))
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) is a
    assert pool.drain_events() == [KVEvent("stored", (h(1).hex(),))]


def test_reset_prefix_cache_forgets_every_hash_and_says_cleared():
    pool = BlockPool(3)
    _cached_and_freed(pool, 3)
    before = replay_kv_events(pool.drain_events())
    assert len(before) == 3
    assert pool.reset_prefix_cache() is True
    assert pool.cached_hashes() == [] and pool.get_cached_block(h(0)) is None
    assert all(b.block_hash is None for b in pool.blocks)
    events = pool.drain_events()
    assert events == [KVEvent("cleared")]
    assert replay_kv_events(events, before) == set()
    # Later blocks evict nothing and announce nothing but their own storage.
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(9))
    assert pool.num_evictions == 0
    assert pool.drain_events() == [KVEvent("stored", (h(9).hex(),))]


def test_undrained_events_replay_to_the_right_state():
    pool = BlockPool(3)
    _cached_and_freed(pool, 2)
    pool.reset_prefix_cache()
    _cached_and_freed(pool, 3, first_hash=10)
    pool.get_new_blocks(1)
    assert replay_kv_events(pool.drain_events()) == set(pool.cached_hashes())


def test_an_undrained_event_backlog_stays_bounded_and_replays_to_the_cached_set():
    pool = BlockPool(4)
    for i in range(5000):  # offline use: nobody drains, blocks cycle through the cache
        (b,) = pool.get_new_blocks(1)
        pool.cache_block(b, h(i))
        pool.free_blocks([b])
    events = pool.drain_events()
    # 10000 changes happened; what is handed over is bounded by the pool, not by history.
    assert sum(len(e.block_hashes) for e in events) <= 2 * pool.num_blocks + 1024
    assert replay_kv_events(events) == set(pool.cached_hashes())
    assert len(pool.cached_hashes()) == 4
    assert pool.num_evictions == 4996


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["touch", "free"]), st.integers(0, 2)), max_size=40))
def test_the_shared_count_is_the_blocks_with_two_or_more_holders(ops):
    """Found by the mutation run (docs/mutation.md): checked after every step, not only at the
    ends of a sequence."""
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    for op, i in ops:
        if op == "touch":
            pool.touch([blocks[i]])
        elif blocks[i].ref_cnt:
            pool.free_blocks([blocks[i]])
        assert pool.num_shared_blocks() == sum(b.ref_cnt >= 2 for b in blocks)
