"""KVEventLog: one tier's prefix-cache changes, batched in order, bounded when never drained."""

from __future__ import annotations

from conftest import replay_kv_events

from kvserve.engine.core.block_hash import hash_block
from kvserve.engine.core.kv_events import KVEvent, KVEventLog


def h(i: int) -> bytes:
    return hash_block(None, [i])


def test_changes_come_out_in_order_with_consecutive_kinds_batched():
    log = KVEventLog("host", 8, lambda: [])
    log.stored(h(1))
    log.stored(h(2))
    log.removed(h(1))
    log.removed(h(2))
    log.stored(h(3))
    assert len(log) == 5
    assert log.drain() == [KVEvent("stored", (h(1).hex(), h(2).hex()), "host"),
                           KVEvent("removed", (h(1).hex(), h(2).hex()), "host"),
                           KVEvent("stored", (h(3).hex(),), "host")]
    assert log.drain() == [] and len(log) == 0


def test_cleared_drops_what_came_before_it():
    log = KVEventLog("device", 8, lambda: [])
    log.stored(h(1))
    log.cleared()
    assert log.drain() == [KVEvent("cleared")]
    log.stored(h(2))
    log.cleared()
    log.stored(h(3))
    assert log.drain() == [KVEvent("cleared"), KVEvent("stored", (h(3).hex(),))]


def test_stored_blocks_carry_their_parent_and_tokens_by_hash():
    log = KVEventLog("device", 8, lambda: [])
    a, b = h(1), hash_block(h(1), [5, 6])
    log.stored(a, None, [1, 2])
    log.stored(b, a, [5, 6])
    log.stored(h(9))  # stored without them (a promoted block): no lineage entry
    (event,) = log.drain()
    assert event.block_hashes == (a.hex(), b.hex(), h(9).hex())
    assert event.lineage == ((a.hex(), None, (1, 2)), (b.hex(), a.hex(), (5, 6)))


def test_a_batch_without_parents_or_tokens_carries_no_lineage():
    log = KVEventLog("disk", 8, lambda: [])
    log.stored(h(1))
    log.removed(h(1))
    assert log.drain() == [KVEvent("stored", (h(1).hex(),), "disk", ()),
                           KVEvent("removed", (h(1).hex(),), "disk", ())]


def test_an_undrained_backlog_is_compacted_and_replays_to_what_the_tier_holds():
    held: dict[bytes, None] = {}
    log = KVEventLog("host", 2, lambda: held)
    limit = 2 * 2 + 1024
    for i in range(3 * limit):  # a two-block LRU tier: store one, drop the oldest
        held[h(i)] = None
        log.stored(h(i))
        if len(held) > 2:
            old = next(iter(held))
            del held[old]
            log.removed(old)
        assert len(log) <= limit
    events = log.drain()
    assert events[0] == KVEvent("cleared", medium="host")
    assert replay_kv_events(events) == {x.hex() for x in held}


def test_the_cache_manager_stores_blocks_with_parent_and_tokens_restores_included():
    from test_kv_cache_manager import BS, make_seq, prefill

    from kvserve.engine.core.block_hash import block_hashes
    from kvserve.engine.core.kv_cache_manager import KVCacheManager

    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    tokens = list(range(1, 14))  # three full blocks of 4 + one token
    a, b, c = block_hashes(tokens, BS)
    want = ((a, None, (1, 2, 3, 4)), (b, a, (5, 6, 7, 8)), (c, b, (9, 10, 11, 12)))
    seq = make_seq(1, tokens)
    prefill(kv, seq)
    (stored,) = kv.pool.drain_events()
    assert stored.block_hashes == (a, b, c) and stored.lineage == want
    kv.free(seq)
    other = make_seq(2, [99] * 13)  # takes every block: the first prompt's go to the host tier
    prefill(kv, other)
    kv.free(other)
    kv.take_tier_moves()
    kv.pool.drain_events()
    again = make_seq(3, tokens + [7])
    prefill(kv, again)  # its three blocks come back from the host tier
    restored = [e for e in kv.pool.drain_events() if e.kind == "stored"]
    assert [x for e in restored for x in e.lineage if x[0] in (a, b, c)] == list(want)
