"""Tier-aware routing on a real redis-server: replicas publish their host-tier blocks in a second
set, the one-round-trip lookup returns the device/host split of the leading match, and the prefix
policy ranks a device holder above a host holder above a miss."""

from __future__ import annotations

import random

import pytest
import redis
from kvserve import LLM, SamplingParams
from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.core.kv_events import KVEvent
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.prefix_index.scripts import add_blocks
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.routing import RouteInfo
from kvserve.service.routing_policy import Candidate, PolicyConfig, decide, prefix_score
from kvserve.service.server.publishing import PublisherObserver
from test_prefix_index import CHAIN, Stats, publisher, until

KEYS = IndexKeys("svc")


def host_event(kind: str, hashes) -> KVEvent:
    return KVEvent(kind, tuple(hashes), medium="host")


async def tiers(index: PrefixIndex, chain) -> dict[str, tuple[int, int]]:
    return {m.replica.replica_id: (m.matched_blocks, m.host_blocks)
            for m in await index.lookup(chain)}


async def _is(coro, expected) -> bool:
    return (await coro) == expected


async def test_lookup_returns_the_device_and_host_split(redis_server):
    pubs = {rid: publisher(redis_server.url, rid) for rid in ("mixed", "host", "hole", "none")}
    index = PrefixIndex.from_url(redis_server.url, "svc")
    for p in pubs.values():
        await p.start()
    try:
        await until(lambda: all(p.connected for p in pubs.values()), what="connect")
        pubs["mixed"].on_step([KVEvent("stored", tuple(CHAIN[:3])),
                               host_event("stored", CHAIN[3:6])])
        pubs["host"].on_step([host_event("stored", CHAIN[:4])])
        # Block 2 in neither set stops the leading match; block 1 in both counts as device.
        pubs["hole"].on_step([KVEvent("stored", tuple(CHAIN[:2])),
                              host_event("stored", CHAIN[1:2] + CHAIN[3:])])
        want = {"mixed": (6, 3), "host": (4, 4), "hole": (2, 0)}
        await until(lambda: _is(tiers(index, CHAIN), {**want, "none": (0, 0)}), what="lookup")
        # The router's per-request call names only the replicas holding the first block.
        assert await index.match_tiers(CHAIN) == want
        assert await index.match_counts(CHAIN) == {r: m for r, (m, _) in want.items()}
        # A block demoted to host memory: the pool says removed, the host tier says stored.
        pubs["mixed"].on_step([KVEvent("removed", (CHAIN[0],)), host_event("stored", CHAIN[:1])])
        await until(lambda: _is(index.match_tiers(CHAIN[:6]), {**want, "mixed": (6, 4)}),
                    what="demotion")
        r = redis.Redis.from_url(redis_server.url)
        assert CHAIN[0].encode() in r.smembers(KEYS.host_blocks("mixed"))
        assert CHAIN[0].encode() not in r.smembers(KEYS.blocks("mixed"))
        # Promoted back: in both sets it counts as a device block.
        pubs["mixed"].on_step([KVEvent("stored", (CHAIN[0],))])
        await until(lambda: _is(index.match_tiers(CHAIN[:6]), {**want, "mixed": (6, 3)}),
                    what="promotion")
        # A host cleared alone leaves the device set alone.
        pubs["mixed"].on_step([KVEvent("cleared", medium="host")])
        await until(lambda: _is(index.match_tiers(CHAIN), {**want, "mixed": (3, 0)}),
                    what="host cleared")
        r.close()
    finally:
        for p in pubs.values():
            await p.close()
        await index.close()


async def test_the_host_set_lives_and_dies_with_the_replica(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    dying = publisher(redis_server.url, "dying", ttl=0.5)
    gone = publisher(redis_server.url, "gone")
    await dying.start(), await gone.start()
    try:
        await until(lambda: dying.connected and gone.connected, what="connect")
        for p in (dying, gone):
            p.on_step([host_event("stored", CHAIN)])
        await until(lambda: _is(index.match_tiers(CHAIN), {"dying": (8, 8), "gone": (8, 8)}),
                    what="host entries written")
        await gone.close()  # a drain: out of routing at once, its entries swept by a scan
        assert await index.match_tiers(CHAIN) == {"dying": (8, 8)}
        await index.scan()
        assert r.exists(KEYS.host_blocks("gone"), KEYS.replica("gone")) == 0
        dying._task.cancel()  # a crash: the heartbeat expires, then a scan sweeps the entries
        await until(lambda: _is(tiers(index, CHAIN), {}), what="the heartbeat expiring")
        await index.scan()
        assert r.exists(KEYS.host_blocks("dying"), KEYS.replica("dying")) == 0
        assert not any(r.exists(KEYS.holders(h)) for h in CHAIN)  # the inverted index is empty
        assert r.hlen(KEYS.slots) == 0 and r.scard(KEYS.dead) == 0
    finally:
        await dying.close(), await gone.close(), await index.close()
        r.close()


async def test_a_snapshot_replaces_both_sets(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    add_blocks(r, KEYS, "a", CHAIN[5:], medium="host")  # left by a previous life of "a"
    p = publisher(redis_server.url, "a")
    await p.start()
    try:
        await until(lambda: p.connected and p.wants_snapshot(), what="connect")
        # The first connect takes the old entries out of both sets and the inverted index.
        assert not r.exists(KEYS.host_blocks("a"), *(KEYS.holders(h) for h in CHAIN[5:]))
        p.on_step([host_event("stored", CHAIN)])  # superseded by the snapshot below
        p.on_step([], snapshot=CHAIN[:2], host_snapshot=CHAIN[2:5])
        await until(lambda: r.scard(KEYS.host_blocks("a")) == 3, what="snapshot")
        assert {h.decode() for h in r.smembers(KEYS.blocks("a"))} == set(CHAIN[:2])
        assert {h.decode() for h in r.smembers(KEYS.host_blocks("a"))} == set(CHAIN[2:5])
        p.on_step([], snapshot=CHAIN[:1])  # no host tier: its set is emptied
        await until(lambda: not r.exists(KEYS.host_blocks("a")), what="empty host snapshot")
        assert r.smembers(KEYS.blocks("a")) == {CHAIN[0].encode()}
    finally:
        await p.close()
        r.close()


def test_prefix_score_ranks_device_above_host_above_miss():
    cfg = PolicyConfig()
    device, host, miss = (Candidate("device", "u", 0, 0.0, 4, 0),
                          Candidate("host", "u", 0, 0.0, 4, 4),
                          Candidate("miss", "u", 0, 0.0, 0, 0))
    scores = [prefix_score(c, 4, 0, cfg) for c in (device, host, miss)]
    assert scores[0] > scores[1] > scores[2]
    assert scores[1] == pytest.approx(cfg.host_weight)
    for order in ([miss, host, device], [host, miss, device], [device, miss, host]):
        ranking = decide("prefix", order, num_blocks=4, block_size=16, cfg=cfg).ranking
        assert [c.replica_id for c in ranking] == ["device", "host", "miss"]
    # host_weight=1: a host hit is worth a device hit (ties broken by load order, not tier).
    assert prefix_score(host, 4, 0, PolicyConfig(host_weight=1.0)) == 1.0
    with pytest.raises(ValueError, match="host_weight"):
        PolicyConfig(host_weight=1.5)


def test_route_info_splits_predicted_tokens_by_tier():
    info = RouteInfo(None, 100, {"a": 96, "b": 64}, {"a": 32, "b": 64})  # type: ignore[arg-type]
    assert info.split("a") == (64, 32)
    assert info.split("b") == (0, 64)
    assert info.split("c") == (0, 0)
    assert RouteInfo(None, 40, {"a": 48}, {"a": 48}).split("a") == (0, 40)  # type: ignore


async def test_a_host_only_replica_ranks_between_the_device_holder_and_a_miss(redis_server):
    pubs = {rid: publisher(redis_server.url, rid) for rid in ("device", "host", "miss")}
    for p in pubs.values():
        await p.start()
    replicas = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc"),
                          RouterMetrics())
    try:
        await until(lambda: all(p.connected for p in pubs.values()), what="connect")
        pubs["device"].on_step([KVEvent("stored", tuple(CHAIN))], Stats(1, 0, 0.1))
        pubs["host"].on_step([host_event("stored", CHAIN)], Stats(1, 0, 0.1))
        pubs["miss"].on_step([], Stats(1, 0, 0.1))

        async def ranking() -> list[str]:
            await replicas.refresh()
            matches = await replicas.lookup(CHAIN)
            cands = [replicas.candidate(m.replica, m.matched_blocks, m.host_blocks)
                     for m in matches]
            d = decide("prefix", cands, num_blocks=len(CHAIN), block_size=16)
            return [c.replica_id for c in d.ranking]

        await until(lambda: _is(ranking(), ["device", "host", "miss"]), what="ranking")
        # The device holder gone, the host holder wins over the miss.
        await pubs["device"].close()
        await until(lambda: _is(ranking(), ["host", "miss"]), what="host over miss")
    finally:
        for p in pubs.values():
            await p.close()
        await replicas.close()


BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


async def test_the_publisher_writes_the_host_set_from_real_engine_events(redis_server,
                                                                         tiny_model_dir):
    """Tenants whose prefixes do not fit the 12-block device pool together: evicted prefix blocks
    move to the host tier, and Redis ends up holding exactly what each tier holds."""
    llm = LLM(str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_memory=1 << 22,
              num_gpu_blocks_override=12, kv_offloading_size=0.01)
    engine = llm.llm_engine
    p = publisher(redis_server.url, "tiered")
    observer = PublisherObserver(p)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    r = redis.Redis.from_url(redis_server.url)
    await p.start()
    try:
        await until(lambda: p.connected, what="connect")
        rng = random.Random(0)
        prefixes = [[rng.randrange(3, 380) for _ in range(5 * BLOCK)] for _ in range(3)]
        for i, prefix in enumerate(prefixes):
            engine.add_request(f"r{i}", prefix + [7, 8, 9], GREEDY)
            while engine.has_unfinished_requests():
                outputs = engine.step()
                # What the AsyncEngine hands its observers after each step.
                observer.after_step(outputs, engine.get_stats(),
                                    engine.drain_kv_events(("device", "host")), engine)
        device, host = set(engine.cached_block_hashes()), set(engine.cached_block_hashes("host"))
        assert host, "the first tenant's prefix should have been offloaded"

        def published(key: str) -> set[str]:
            return {h.decode() for h in r.smembers(key)}

        await until(lambda: published(KEYS.host_blocks("tiered")) == host
                    and published(KEYS.blocks("tiered")) == device, what="both sets published")
        first = block_hashes(prefixes[0], BLOCK)
        matched, on_host = (await index.match_tiers(first))["tiered"]
        assert matched == len(first) and on_host > 0  # the evicted tenant: a host hit
        last = block_hashes(prefixes[-1], BLOCK)
        assert (await index.match_tiers(last))["tiered"] == (len(last), 0)  # still on device
    finally:
        await p.close(), await index.close()
        r.close()
