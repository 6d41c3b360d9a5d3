"""The Redis prefix index on a real redis-server: publisher events, heartbeats, TTL, outages."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest
import redis
from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.core.kv_events import KVEvent
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.prefix_index.publisher import PrefixIndexPublisher
from kvserve.service.prefix_index.scripts import WRITE_CHUNK, add_blocks, write_calls


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


CHAIN = block_hashes(list(range(16 * 8)), 16)  # 8 chained blocks


async def until(cond, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll an (async) condition; fail with `what` if it does not hold within `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        value = cond()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def publisher(url: str, rid: str, **kw) -> PrefixIndexPublisher:
    kw.setdefault("heartbeat_interval", 0.1)
    return PrefixIndexPublisher(url, "svc", rid, f"http://{rid}:8000", "tiny", 16, **kw)


async def matches(index: PrefixIndex, chain) -> dict[str, int]:
    return {m.replica.replica_id: m.matched_blocks for m in await index.lookup(chain)}


async def test_lookup_returns_leading_match_per_live_replica(redis_server):
    a, b = publisher(redis_server.url, "a"), publisher(redis_server.url, "b")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await a.start(), await b.start()
    try:
        await until(lambda: a.connected and b.connected, what="connect")
        a.on_step([KVEvent("stored", tuple(CHAIN[:5]))], Stats(2, 1, 0.25))
        # b holds blocks 0-1 and 3-7: the hole at block 2 stops its leading match at 2.
        b.on_step([KVEvent("stored", tuple(CHAIN[:2] + CHAIN[3:]))], Stats())
        await until(lambda: _eq(matches(index, CHAIN), {"a": 5, "b": 2}), what="lookup")
        assert await index.match_counts(CHAIN) == {"a": 5, "b": 2}  # the router's fast path
        other = block_hashes(list(range(1, 16 * 8 + 1)), 16)  # another prompt: nothing held
        assert await index.match_counts(other) == {}  # only replicas holding its first block
        await until(lambda: _eq(_loads(index), {"a": 3, "b": 0}), what="next heartbeat")
        infos = {i.replica_id: i for i in await index.replicas()}
        assert infos["a"].url == "http://a:8000" and infos["a"].model == "tiny"
        assert (infos["a"].num_running, infos["a"].num_waiting) == (2, 1)
        assert infos["a"].kv_cache_usage == 0.25 and infos["a"].block_size == 16
        other = block_hashes(list(range(1000, 1000 + 64)), 16)
        assert await matches(index, other) == {"a": 0, "b": 0}
    finally:
        await a.close(), await b.close(), await index.close()


async def test_heartbeats_carry_the_resident_adapters(redis_server):
    """The callback is read at every heartbeat; a replica without it (or a heartbeat written
    before the field existed) reads as holding no adapter; a failing callback keeps the last
    list; a garbage list is a malformed heartbeat, not a crash."""
    resident = {"sql-lora"}
    calls = []

    def adapters():
        calls.append(1)
        if resident == {"boom"}:
            raise RuntimeError("engine busy")
        return list(resident)

    a = publisher(redis_server.url, "a", adapters=adapters)
    b = publisher(redis_server.url, "b")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await a.start(), await b.start()

    async def held() -> dict[str, frozenset[str]]:
        return {i.replica_id: i.adapters for i in await index.replicas()}

    try:
        await until(lambda: _eq(held(), {"a": frozenset({"sql-lora"}), "b": frozenset()}),
                    what="first heartbeats")
        resident.add("chat-lora")
        await until(lambda: _eq(held(), {"a": frozenset({"sql-lora", "chat-lora"}),
                                         "b": frozenset()}), what="the next heartbeat")
        resident.clear()
        resident.add("boom")
        n = len(calls)
        await until(lambda: len(calls) > n + 1, what="two failing reads")
        assert (await held())["a"] == frozenset({"sql-lora", "chat-lora"})
        r = redis.Redis.from_url(redis_server.url)
        old = IndexKeys("svc").replica("old")  # an old replica's heartbeat: no adapters field
        r.hset(old, mapping={"url": "http://old:8000", "heartbeat_at": "1"})
        r.sadd(IndexKeys("svc").replicas, "old")
        await b.close()
        assert (await held())["old"] == frozenset()
        r.hset(old, "adapters", '{"not": "a list"}')
        scan = await index.scan()
        assert [rid for rid, _ in scan.malformed] == ["old"]
        assert "adapters" in scan.malformed[0][1]
        r.close()
    finally:
        await a.close(), await b.close(), await index.close()


async def _loads(index: PrefixIndex) -> dict[str, int]:
    return {i.replica_id: i.load for i in await index.replicas()}


async def _eq(coro, expected) -> bool:
    return (await coro) == expected


async def test_removed_and_cleared_events(redis_server):
    p = publisher(redis_server.url, "a")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        p.on_step([KVEvent("stored", tuple(CHAIN))])
        await until(lambda: _eq(matches(index, CHAIN), {"a": 8}), what="stored")
        p.on_step([KVEvent("removed", (CHAIN[6],))])
        await until(lambda: _eq(matches(index, CHAIN), {"a": 6}), what="removed")
        p.on_step([KVEvent("cleared"), KVEvent("stored", (CHAIN[0],))])
        await until(lambda: _eq(matches(index, CHAIN), {"a": 1}), what="cleared then stored")
    finally:
        await p.close(), await index.close()


async def test_replica_vanishes_when_heartbeat_stops(redis_server):
    p = publisher(redis_server.url, "dying", ttl=0.5)
    live = publisher(redis_server.url, "live")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start(), await live.start()
    try:
        await until(lambda: p.connected and live.connected, what="connect")
        p.on_step([KVEvent("stored", tuple(CHAIN))])
        await until(lambda: _eq(matches(index, CHAIN), {"dying": 8, "live": 0}), what="stored")
        p._task.cancel()  # a crash: no goodbye, the heartbeat simply stops
        await until(lambda: _eq(matches(index, CHAIN), {"live": 0}), what="TTL expiry")
        r = redis.Redis.from_url(redis_server.url)
        keys = IndexKeys("svc")
        assert r.smembers(keys.replicas) == {b"live"}  # swept by the lookup
        # The scan that found it dead also took its block entries out (8 < the sweep budget).
        assert not r.exists(keys.blocks("dying"), keys.replica("dying"),
                            *(keys.holders(h) for h in CHAIN))
        assert not r.hexists(keys.slots, "dying") and r.scard(keys.dead) == 0
        assert r.exists(keys.blocks("live")) == 0 and r.exists(keys.replica("live")) == 1
        r.close()
    finally:
        await p.close(), await live.close(), await index.close()


async def test_close_removes_entries_at_once(redis_server):
    p = publisher(redis_server.url, "a", heartbeat_interval=5.0)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start()
    await until(lambda: p.connected, what="connect")
    p.on_step([KVEvent("stored", tuple(CHAIN))])
    await until(lambda: _eq(matches(index, CHAIN), {"a": 8}), what="stored")
    await p.close()
    assert await index.lookup(CHAIN) == []
    await index.close()


async def test_services_are_namespaced(redis_server):
    p = publisher(redis_server.url, "a")
    own = PrefixIndex.from_url(redis_server.url, "svc")
    other = PrefixIndex.from_url(redis_server.url, "other-svc")
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        p.on_step([KVEvent("stored", tuple(CHAIN))])
        await until(lambda: _eq(matches(own, CHAIN), {"a": 8}), what="stored in its service")
        assert await other.lookup(CHAIN) == []
    finally:
        await p.close(), await own.close(), await other.close()


async def test_redis_outage_drops_events_then_republishes_snapshot(redis_server):
    p = publisher(redis_server.url, "a")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        assert p.wants_snapshot()  # a fresh connection asks for the full set
        p.on_step([], Stats(), snapshot=CHAIN[:3])
        assert not p.wants_snapshot()
        await until(lambda: _eq(matches(index, CHAIN), {"a": 3}), what="first snapshot")

        redis_server.stop()
        await until(lambda: not p.connected, what="publisher noticing the outage")
        assert not p.wants_snapshot()  # no point computing a snapshot while Redis is down
        dropped = p.dropped_events
        p.on_step([KVEvent("stored", tuple(CHAIN[3:6]))], Stats(1, 0, 0.1))
        assert p.dropped_events == dropped + 3
        assert p.redis_errors > 0

        redis_server.start()  # an empty Redis: everything was lost
        await until(p.wants_snapshot, what="reconnect asking for a snapshot")
        p.on_step([KVEvent("stored", (CHAIN[6],))], Stats(), snapshot=CHAIN[:7])
        await until(lambda: _eq(matches(index, CHAIN), {"a": 7}), what="republished set")
    finally:
        await p.close(), await index.close()


async def test_queue_overflow_drops_and_asks_for_snapshot(redis_server):
    p = publisher(redis_server.url, "a", max_pending_hashes=4)
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        p.on_step([], snapshot=[])  # consume the initial snapshot request
        assert not p.wants_snapshot()
        p.on_step([KVEvent("stored", tuple(CHAIN[:6]))])
        assert p.dropped_events == 6
        assert p.wants_snapshot()
    finally:
        await p.close()


async def test_on_step_from_many_threads(redis_server):
    p = publisher(redis_server.url, "a")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        hashes = block_hashes(list(range(16 * 400)), 16)

        def worker(part: list[str]) -> None:
            for h in part:
                p.on_step([KVEvent("stored", (h,))], Stats())

        threads = [threading.Thread(target=worker, args=(hashes[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        await asyncio.to_thread(lambda: [t.join() for t in threads])
        await until(lambda: _eq(matches(index, hashes), {"a": 400}), what="all 400 blocks")
        assert p.dropped_events == 0
    finally:
        await p.close(), await index.close()


async def test_on_step_does_not_wait_for_a_dead_redis(redis_server):
    # Redis is gone before start: on_step must still return at once, every time.
    redis_server.stop()
    p = publisher(redis_server.url, "a")
    await p.start()
    try:
        done = await asyncio.to_thread(
            lambda: [p.on_step([KVEvent("stored", (h,))], Stats()) for h in CHAIN] or True)
        assert done and p.dropped_events == len(CHAIN) and not p.connected
    finally:
        await p.close()


async def test_an_expired_entry_asks_for_a_snapshot(redis_server):
    # A frozen replica (SIGSTOP, a long pause) comes back after its keys expired: republish.
    p = publisher(redis_server.url, "a")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        p.on_step([], Stats(), snapshot=CHAIN)
        await until(lambda: _eq(matches(index, CHAIN), {"a": 8}), what="snapshot")
        assert not p.wants_snapshot()
        r = redis.Redis.from_url(redis_server.url)
        r.delete(IndexKeys("svc").replica("a"))  # its heartbeat expired
        r.close()
        await index.scan()  # a router's scan finds it dead and takes its entries out
        await until(p.wants_snapshot, what="the publisher noticing its entry was gone")
        p.on_step([], Stats(), snapshot=CHAIN[:4])
        await until(lambda: _eq(matches(index, CHAIN), {"a": 4}), what="republished")
    finally:
        await p.close(), await index.close()


async def test_lookup_rejects_hashes_that_are_not_engine_block_hashes(redis_server):
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        assert await index.lookup([]) == []
        with pytest.raises(ValueError, match="32-hex-digit"):
            await index.lookup(["abc", CHAIN[0]])
    finally:
        await index.close()


def heartbeats(r: redis.Redis, keys: IndexKeys, ids) -> None:
    """Minimal live heartbeats, written directly (no publisher per replica)."""
    pipe = r.pipeline(transaction=False)
    for rid in ids:
        pipe.hset(keys.replica(rid), mapping={"url": f"http://{rid}:8000", "heartbeat_at": "1"})
        pipe.sadd(keys.replicas, rid)
    pipe.execute()


async def test_lookup_walks_more_holders_than_one_redis_call_takes(redis_server):
    # 1,100 replicas hold the chain's first block: the walk splits its SMISMEMBER calls (2,000
    # holder codes each) and rebuilds its codes as holders drop out.
    r = redis.Redis.from_url(redis_server.url)
    keys = IndexKeys("svc")
    want = {f"r{i:04d}": 1 + i % 8 for i in range(1100)}  # r<i> holds the first 1 + i % 8 blocks
    heartbeats(r, keys, want)
    for rid, n in want.items():
        add_blocks(r, keys, rid, CHAIN[:n], medium="host" if rid.endswith("7") else "device")
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        tiers = await index.match_tiers(CHAIN)
        assert {rid: m for rid, (m, _) in tiers.items()} == want
        assert all(host == (m if rid.endswith("7") else 0) for rid, (m, host) in tiers.items())
    finally:
        await index.close()
        r.close()


async def test_lookup_of_a_prefix_many_replicas_hold(redis_server):
    # 20 holders: while a block's holder set equals the previous block's, the walk compares the
    # sets instead of testing each holder; where they differ it tests each one again.
    r = redis.Redis.from_url(redis_server.url)
    keys = IndexKeys("svc")
    heartbeats(r, keys, [f"r{i:02d}" for i in range(20)])
    for i in range(20):
        rid = f"r{i:02d}"
        held = CHAIN[:4] + CHAIN[5:] if rid == "r05" else CHAIN  # r05 lost block 4
        add_blocks(r, keys, rid, held, medium="host" if i >= 15 else "device")
    add_blocks(r, keys, "r16", CHAIN[6:7])  # block 6 of r16 also back on the device
    want = {f"r{i:02d}": (8, 8 if i >= 15 else 0) for i in range(20)}
    want["r05"], want["r16"] = (4, 0), (8, 7)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        assert await index.match_tiers(CHAIN) == want
        assert {m.replica.replica_id: (m.matched_blocks, m.host_blocks)
                for m in await index.lookup(CHAIN) if m.replica.replica_id in want} == want
    finally:
        await index.close()
        r.close()


async def test_a_dead_replica_is_swept_in_bounded_steps(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    keys = IndexKeys("svc")
    long_chain = block_hashes(list(range(16 * 2500)), 16)
    add_blocks(r, keys, "dead", long_chain[:2000])
    add_blocks(r, keys, "dead", long_chain[2000:], medium="host")
    r.sadd(keys.replicas, "dead")  # its heartbeat key is gone: the next scan finds it dead
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        assert (await index.scan(sweep=1000)).matches == []
        assert r.smembers(keys.dead) == {b"dead"}
        assert r.scard(keys.blocks("dead")) + r.scard(keys.host_blocks("dead")) == 1500
        assert await index.match_counts(long_chain) == {}  # half-swept: never routed to
        await index.scan(sweep=1000)
        await index.scan(sweep=1000)
        assert not r.exists(keys.blocks("dead"), keys.host_blocks("dead"), keys.dead)
        assert not any(r.exists(keys.holders(h)) for h in long_chain[::97])
        assert not r.hexists(keys.slots, "dead")
    finally:
        await index.close()
        r.close()


def test_writes_are_split_into_bounded_calls_in_order():
    keys = IndexKeys("svc")
    a, b = CHAIN * 300, CHAIN[:3]  # 2,400 and 3 hashes
    calls = write_calls(keys, "r", [("add", "device", a), ("remove", "host", b)])
    flat = []
    for call in calls:
        assert call[:2] == [keys.prefix, "r"]
        groups = [call[i : i + 3] for i in range(2, len(call), 3)]
        assert sum(len(blob) // 32 for _, _, blob in groups) <= WRITE_CHUNK
        flat += [(op, medium, blob[i : i + 32]) for op, medium, blob in groups
                 for i in range(0, len(blob), 32)]
    assert flat == [("add", "device", h) for h in a] + [("remove", "host", h) for h in b]
    assert len(calls) == -(-(len(a) + len(b)) // WRITE_CHUNK)
    with pytest.raises(ValueError, match="32-hex-digit"):
        write_calls(keys, "r", [("add", "device", ["abc"])])


def test_a_service_name_must_make_a_hash_tag():
    for bad in ("", "a{b", "a}b"):
        with pytest.raises(ValueError, match="--service-name"):
            IndexKeys(bad)


@pytest.mark.parametrize("sizes, per_call", [
    ([600, 400], [1000]),             # exactly a chunk: one call
    ([600, 401], [600, 401]),         # one hash over: the second op starts a call
    ([600, 401, 599], [600, 1000]),   # the count restarts at the split
    ([600, 401, 600], [600, 401, 600]),
])
def test_ops_share_a_call_up_to_exactly_write_chunk_hashes(sizes, per_call):
    assert WRITE_CHUNK == 1000  # the cases above are written for it
    hashes = CHAIN * 100
    ops = [("add", "device", hashes[:n]) for n in sizes]
    calls = write_calls(IndexKeys("svc"), "r", ops)
    assert [sum(len(blob) // 32 for blob in call[4::3]) for call in calls] == per_call
