"""The prefix index on Redis Sentinel and Redis Cluster, for real: redis-server processes on
ephemeral ports, a real PrefixIndexPublisher fed like the engine feeds it, and the router's own
ReplicaSet reading through the `redis+sentinel://` / `redis+cluster://` URL. Killing the primary
(kill -9) must degrade routing to least load only until the failover, after which prefix routing
comes back with the blocks the replica cached meanwhile (its snapshot is republished)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from redis_topology import RedisClusterSet, SentinelSet

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.core.kv_events import KVEvent
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.prefix_index.publisher import PrefixIndexPublisher
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.server.publishing import PublisherObserver

SERVICE = "ha"
CHAIN = block_hashes(list(range(16 * 8)), 16)  # 8 chained blocks
FAILOVER_LIMIT = 30.0  # seconds; Sentinel and Cluster both take a few here (down-after 1 s)


@dataclass
class Stats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class Engine:
    """What the publisher observer reads from the engine: the device pool's cached hashes."""

    device: list[str] = field(default_factory=list)

    def cached_block_hashes(self, medium: str = "device") -> list[str]:
        return list(self.device) if medium == "device" else []


class Replica:
    """A real publisher fed by the server's own PublisherObserver after each fake step."""

    def __init__(self, url: str, rid: str, service: str = SERVICE) -> None:
        self.publisher = PrefixIndexPublisher(url, service, rid, f"http://{rid}:8000", "tiny", 16,
                                              heartbeat_interval=0.2)  # TTL 2 s
        self.observer = PublisherObserver(self.publisher)
        self.engine = Engine()
        self._events: list[KVEvent] = []
        self._task: asyncio.Task | None = None

    def store(self, hashes: list[str]) -> None:
        """The engine cached `hashes`: its next step reports them."""
        self.engine.device += hashes
        self._events.append(KVEvent("stored", tuple(hashes)))

    async def start(self) -> Replica:
        await self.publisher.start()
        self._task = asyncio.create_task(self._steps())
        return self

    async def _steps(self) -> None:
        while True:
            events, self._events = self._events, []
            self.observer.after_step([], Stats(), events, self.engine)
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.publisher.close()


async def until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await cond()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def router_view(router: ReplicaSet) -> tuple[str, dict[str, int]]:
    """One refresh (the router's 1 s loop) and one per-request lookup: ("prefix", matches) while
    Redis answers, ("least-load", matches) when it does not (the known replicas, no match)."""
    await router.refresh()
    matches = {m.replica.replica_id: m.matched_blocks for m in await router.lookup(CHAIN)}
    return ("prefix" if router.redis_up else "least-load"), matches


async def survive_primary_death(url: str, kill_primary, replica_id: str = "r1") -> dict:
    """Publish 4 blocks, kill the primary, cache 4 more during the failover; the router must keep
    answering, by load alone while Redis is unreachable, and route by prefix with all 8 blocks
    after the failover.
    Returns what happened: seconds degraded, the slowest router call, the state sequence."""
    replica = await Replica(url, replica_id).start()
    router = ReplicaSet(RouterConfig(redis_url=url, service_name=SERVICE, redis_timeout=0.5),
                        RouterMetrics())
    try:
        replica.store(CHAIN[:4])
        await until(lambda: _equals(router_view(router), ("prefix", {replica_id: 4})), 15,
                    "first publish")
        kill_primary()
        killed_at = time.monotonic()
        replica.store(CHAIN[4:])  # cached during the failover: a lost event, or a snapshot
        states, degraded, slowest = [], 0.0, 0.0
        while time.monotonic() - killed_at < FAILOVER_LIMIT:
            t0 = time.monotonic()
            state, matches = await router_view(router)
            slowest = max(slowest, time.monotonic() - t0)
            if state == "least-load":
                assert matches == {replica_id: 0}  # still routable, by load alone
                degraded += time.monotonic() - t0 + 0.1
            else:  # 0: Redis is back but the heartbeat expired meanwhile, not yet renewed
                assert matches in ({replica_id: 0}, {replica_id: 4}, {replica_id: 8}), matches
            if not states or states[-1] != (state, matches.get(replica_id)):
                states.append((state, matches.get(replica_id)))
            if (state, matches) == ("prefix", {replica_id: 8}):
                break
            await asyncio.sleep(0.1)
        assert states[-1] == ("prefix", 8), f"no prefix routing after the failover: {states}"
        # The router noticed the death and answered by load (rather than waiting on retries).
        assert ("least-load", 0) in states, states
        assert replica.publisher.connected
        return {"degraded_s": round(degraded, 1), "slowest_call_s": round(slowest, 2),
                "recovered_after_s": round(time.monotonic() - killed_at, 1), "states": states,
                "publisher_errors": replica.publisher.redis_errors}
    finally:
        await router.close()
        await replica.close()


async def _equals(value, expected) -> bool:
    return await value == expected


async def test_an_index_back_without_heartbeats_keeps_the_known_replicas(redis_server):
    """A Redis restarted empty (or a failover that outlasted the heartbeat TTL) holds no
    heartbeat until the replicas write again: the router keeps the replicas it knew instead of
    answering 503 meanwhile; at startup an empty index still means no replica."""
    replica = await Replica(redis_server.url, "r1").start()
    router = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name=SERVICE),
                        RouterMetrics())
    fresh = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name=SERVICE),
                       RouterMetrics())
    try:
        await until(lambda: _equals(router_view(router), ("prefix", {"r1": 0})), 10, "r1")
        await replica.close()  # no heartbeats from now on
        redis_server.stop()
        assert await router_view(router) == ("least-load", {"r1": 0})
        redis_server.start()  # empty
        assert await router_view(router) == ("prefix", {"r1": 0})  # kept, not forgotten
        assert await router_view(fresh) == ("prefix", {})  # starting up: nothing to keep
    finally:
        await router.close()
        await fresh.close()
        await replica.close()


# ---- Sentinel -------------------------------------------------------------------------------

@pytest.fixture
def sentinel_set(tmp_path):
    topology = SentinelSet(tmp_path, password="s3cret-pw")
    try:
        yield topology.start()
    finally:
        topology.stop()


async def test_sentinel_failover_keeps_the_index(sentinel_set, monkeypatch):
    """The password comes from KVSERVE_REDIS_PASSWORD and serves the sentinels and the data
    nodes alike (Bitnami's auth.sentinel: true)."""
    monkeypatch.setenv("KVSERVE_REDIS_PASSWORD", sentinel_set.password)
    old = sentinel_set.master_port()
    assert old == sentinel_set.primary.port
    report = await survive_primary_death(sentinel_set.url(), sentinel_set.primary.kill)
    print("sentinel failover:", report)
    assert sentinel_set.master_port() == sentinel_set.replica.port  # failed over


async def test_sentinel_password_in_the_url(sentinel_set, monkeypatch):
    monkeypatch.delenv("KVSERVE_REDIS_PASSWORD", raising=False)
    index = PrefixIndex.from_url(sentinel_set.url(with_password=True), SERVICE)
    try:
        assert await index.lookup(CHAIN) == []
        await index.client.set("probe", "1")
        assert sentinel_set._client(sentinel_set.primary).get("probe") == "1"
    finally:
        await index.close()


async def test_sentinels_without_a_password_of_their_own(tmp_path, monkeypatch):
    """The data nodes require a password, the sentinels have none (the Valkey chart's
    sentinel.auth.enabled=false). `?sentinel_auth=false` keeps the password from the sentinels;
    without it redis-py's RESP3 handshake (HELLO 3 AUTH) is accepted too, since a user without a
    password takes any (an old RESP2 client would get "AUTH called without any password")."""
    topology = SentinelSet(tmp_path, password="data-pw", sentinel_auth=False)
    monkeypatch.setenv("KVSERVE_REDIS_PASSWORD", "data-pw")
    try:
        topology.start()
        for url in (topology.url() + "?sentinel_auth=false", topology.url()):
            replica = await Replica(url, "r1").start()
            index = PrefixIndex.from_url(url, SERVICE)
            try:
                replica.store(CHAIN[:2])
                await until(lambda i=index: _equals(_matched(i), {"r1": 2}), 10, f"index at {url}")
            finally:
                await index.close()
                await replica.close()
    finally:
        topology.stop()


async def _matched(index: PrefixIndex) -> dict[str, int]:
    return {m.replica.replica_id: m.matched_blocks for m in await index.lookup(CHAIN)}


# ---- Cluster --------------------------------------------------------------------------------

@pytest.fixture
def redis_cluster(tmp_path):
    topology = RedisClusterSet(tmp_path, masters=3)
    try:
        yield topology.start()
    finally:
        topology.stop()


def services_on_two_nodes(cluster: RedisClusterSet) -> tuple[str, str]:
    """Two service names whose index slots are served by different masters."""
    first = "svc0"
    owner = cluster.owner_of(IndexKeys(first).replicas).port
    for i in range(1, 64):
        name = f"svc{i}"
        if cluster.owner_of(IndexKeys(name).replicas).port != owner:
            return first, name
    raise AssertionError("64 service names all hash to one node")


async def test_cluster_index_reads_writes_and_spreads_services(redis_cluster):
    a, b = services_on_two_nodes(redis_cluster)
    replicas = [await Replica(redis_cluster.url, f"r-{s}", s).start() for s in (a, b)]
    indexes = {s: PrefixIndex.from_url(redis_cluster.url, s) for s in (a, b)}
    try:
        replicas[0].store(CHAIN[:3])
        replicas[1].store(CHAIN[:6])

        async def both() -> bool:
            got = {s: {m.replica.replica_id: m.matched_blocks
                       for m in await indexes[s].lookup(CHAIN)} for s in (a, b)}
            return got == {a: {f"r-{a}": 3}, b: {f"r-{b}": 6}}
        await until(both, 15, "both services' blocks through the cluster")
        assert await indexes[a].match_counts(CHAIN) == {f"r-{a}": 3}
        # Every key of one service (whatever the layout) sits on the node owning its hash tag's
        # slot, none elsewhere, and the two services' nodes differ.
        for service in (a, b):
            keys = IndexKeys(service)
            owner = redis_cluster.owner_of(keys.replicas)
            for node in redis_cluster.nodes:
                local = set(node.client().keys(keys.prefix + "*"))
                if node is owner:
                    assert {keys.replicas, keys.replica(f"r-{service}")} <= local
                    assert len(local) >= 3  # and the block entries
                elif node.client().info("replication")["role"] == "master":
                    assert local == set()
        assert redis_cluster.owner_of(IndexKeys(a).replicas).port != \
            redis_cluster.owner_of(IndexKeys(b).replicas).port
        # Leaving (a drain) removes the replica's entries in one pipeline on the slot's node.
        for replica, service in zip(replicas, (a, b), strict=True):
            await replica.close()
            keys, rid = IndexKeys(service), f"r-{service}"
            node = redis_cluster.owner_of(keys.replicas).client()
            assert node.exists(keys.replica(rid)) == 0
            assert not node.sismember(keys.replicas, rid)
    finally:
        for index in indexes.values():
            await index.close()
        for replica in replicas:
            await replica.close()


@pytest.fixture
def redis_cluster_with_replicas(tmp_path):
    topology = RedisClusterSet(tmp_path, masters=3, replicas_per_master=1)
    try:
        yield topology.start()
    finally:
        topology.stop()


async def test_cluster_master_failover_keeps_the_index(redis_cluster_with_replicas):
    cluster = redis_cluster_with_replicas
    owner = cluster.owner_of(IndexKeys(SERVICE).replicas)
    report = await survive_primary_death(cluster.url, owner.kill)
    print("cluster failover:", report)
    new_owner = cluster.owner_of(IndexKeys(SERVICE).replicas)
    assert new_owner.port != owner.port  # a replica took over the slot
