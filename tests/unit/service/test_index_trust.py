"""What the router trusts in the Redis index, on a real redis-server: garbage is skipped and
logged (never raised), heartbeats are signed with the registration token, draining replicas are
left out, the password comes from the environment and never reaches a log line."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time

import pytest
import redis
from kvserve.engine.core.block_hash import block_hashes
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.prefix_index.publisher import PrefixIndexPublisher
from kvserve.service.prefix_index.redis_client import REDIS_PASSWORD_ENV, redact_url
from kvserve.service.prefix_index.replica_info import (DRAINING_FIELD, DRAINING_VALUE,
                                                       REGISTRATION_TOKEN_ENV, SIGNATURE_FIELD,
                                                       sign_heartbeat)
from kvserve.service.prefix_index.scripts import add_blocks
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet

CHAIN = block_hashes(list(range(16 * 4)), 16)
OTHER = block_hashes(list(range(100, 100 + 16 * 4)), 16)
KEYS = IndexKeys("svc")


def good_beat(rid: str, token: str | None = None, age: float = 0.0,
              **extra: str) -> dict[str, str]:
    beat = {"url": f"http://{rid}:8000", "model": "tiny", "block_size": "16",
            "num_running": "0", "num_waiting": "0", "kv_cache_usage": "0.0",
            "heartbeat_at": f"{time.time() - age:.6f}", **extra}
    if token is not None:
        beat[SIGNATURE_FIELD] = sign_heartbeat(token, rid, beat["url"], beat["heartbeat_at"])
    return beat


def register(r: redis.Redis, rid: str, fields: dict[str, str], blocks=CHAIN) -> None:
    r.hset(KEYS.replica(rid), mapping=fields)
    r.sadd(KEYS.replicas, rid)
    if blocks:
        add_blocks(r, KEYS, rid, blocks)


def write_garbage(r: redis.Redis) -> None:
    """Every kind of junk a bug or a hostile writer could leave under the service's prefix."""
    register(r, "bad-int", good_beat("bad-int", block_size="sixteen"))
    register(r, "bad-url", good_beat("bad-url", url="javascript:alert(1)"))
    register(r, "nan-load", good_beat("nan-load", kv_cache_usage="nan"))
    register(r, "huge", good_beat("huge", num_running="9" * 5000))
    register(r, "no-fields", {"unrelated": "x"})
    r.set(KEYS.replica("a-string"), "not a hash")
    r.sadd(KEYS.replicas, "a-string")
    r.hset(KEYS.prefix.encode() + b"replica:\xff\xfe", mapping=good_beat("x"))
    r.sadd(KEYS.replicas, b"\xff\xfe")
    r.hset(KEYS.replica("bytes"), mapping={**good_beat("bytes"), "model": b"\xc3\x28"})
    r.sadd(KEYS.replicas, "bytes")
    # A good heartbeat whose block set is not a set, and one whose set holds non-hex junk.
    register(r, "wrongtype-blocks", good_beat("wrongtype-blocks"), blocks=None)
    r.set(KEYS.blocks("wrongtype-blocks"), "junk")
    register(r, "junk-blocks", good_beat("junk-blocks"), blocks=None)
    r.sadd(KEYS.blocks("junk-blocks"), "zz" * 16, "not hex", "!")
    # Holders that name no replica (not integers, negative, a slot nobody has), and a holder
    # set of the wrong type.
    r.sadd(KEYS.holders(CHAIN[0]), "junk", "-7", "3.5", "999999")
    r.set(KEYS.holders(OTHER[0]), "not a set")


async def test_garbage_in_the_index_is_skipped_with_reasons(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    register(r, "good", good_beat("good"))
    write_garbage(r)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        scan = await index.scan(CHAIN)
        matched = {m.replica.replica_id: m.matched_blocks for m in scan.matches}
        assert matched == {"good": 4, "wrongtype-blocks": 0, "junk-blocks": 0}
        bad = dict(scan.malformed)
        assert set(bad) == {"bad-int", "bad-url", "nan-load", "huge", "no-fields", "a-string",
                            "\ufffd\ufffd", "bytes"}
        assert "block_size" in bad["bad-int"] and "url" in bad["bad-url"]
        # The per-request path answers too: every live holder (the router keeps only the
        # replicas its scan admitted), none of the junk holders.
        holders = ("good", "bad-int", "bad-url", "nan-load", "huge", "no-fields")
        assert await index.match_counts(CHAIN) == dict.fromkeys(holders, 4)
        assert await index.match_counts(OTHER) == {}
        # A replica writes over garbage in its own set and in the holder sets.
        add_blocks(r, KEYS, "wrongtype-blocks", CHAIN)
        assert (await index.match_counts(CHAIN))["wrongtype-blocks"] == len(CHAIN)
    finally:
        await index.close()


async def test_the_replica_set_logs_each_bad_entry_once_and_routes_the_good(redis_server,
                                                                             caplog):
    r = redis.Redis.from_url(redis_server.url)
    register(r, "good", good_beat("good"))
    write_garbage(r)
    metrics = RouterMetrics()
    replicas = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc"), metrics)
    caplog.set_level(logging.INFO, logger="kvserve.router")
    try:
        await replicas.refresh()
        await replicas.refresh()
        assert replicas.redis_up
        assert set(replicas.known) == {"good", "wrongtype-blocks", "junk-blocks"}
        left_out = [r.message for r in caplog.records if "left out of routing" in r.message]
        assert len(left_out) == 8  # one line per bad entry, not one per refresh
        matches = {m.replica.replica_id: m.matched_blocks for m in await replicas.lookup(CHAIN)}
        assert matches["good"] == 4 and "bad-int" not in matches
        assert replicas._pending_refresh is None  # known garbage does not trigger refreshes
    finally:
        await replicas.close()


async def test_the_whole_replicas_key_of_the_wrong_type_is_a_logged_redis_failure(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    r.set(KEYS.replicas, "not a set")
    replicas = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc",
                                       replicas=("http://static:1",)), RouterMetrics())
    try:
        await replicas.refresh()
        assert not replicas.redis_up and list(replicas.known) == ["http://static:1"]
    finally:
        await replicas.close()


async def test_only_replicas_signed_with_the_token_are_routed(redis_server, caplog):
    r = redis.Redis.from_url(redis_server.url)
    register(r, "signed", good_beat("signed", token="s3cret"))
    register(r, "unsigned", good_beat("unsigned"))
    register(r, "other-token", good_beat("other-token", token="guess"))
    forged = good_beat("forged", token="s3cret")
    forged["url"] = "http://attacker:8000"  # a copied signature does not cover another URL
    register(r, "forged", forged)
    cfg = RouterConfig(redis_url=redis_server.url, service_name="svc",
                       registration_token="s3cret")
    replicas = ReplicaSet(cfg, RouterMetrics())
    caplog.set_level(logging.WARNING, logger="kvserve.router")
    try:
        await replicas.refresh()
        assert set(replicas.known) == {"signed"}
        assert replicas.ignored == {"unsigned", "other-token", "forged"}
        assert sum("registration token" in m for m in caplog.messages) == 3
        open_router = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc"),
                                 RouterMetrics())
        await open_router.refresh()  # without a token every well-formed replica is routed
        assert set(open_router.known) == {"signed", "unsigned", "other-token", "forged"}
        await open_router.close()
    finally:
        await replicas.close()


async def test_a_replayed_signed_heartbeat_is_left_out(redis_server, caplog):
    """A signed heartbeat written back later (keeping a dead replica routable) is stale: its
    timestamp, which the signature covers, is too far from the router's clock."""
    r = redis.Redis.from_url(redis_server.url)
    register(r, "fresh", good_beat("fresh", token="s3cret", age=5))
    register(r, "replayed", good_beat("replayed", token="s3cret", age=120))
    register(r, "future", good_beat("future", token="s3cret", age=-120))
    cfg = RouterConfig(redis_url=redis_server.url, service_name="svc",
                       registration_token="s3cret", heartbeat_max_age=30)
    replicas = ReplicaSet(cfg, RouterMetrics())
    caplog.set_level(logging.WARNING, logger="kvserve.router")
    try:
        await replicas.refresh()
        assert set(replicas.known) == {"fresh"}
        assert replicas.ignored == {"replayed", "future"}
        assert any("-120 s off" in m or "+120 s off" in m for m in caplog.messages)
        lenient = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc",
                                          registration_token="s3cret", heartbeat_max_age=600),
                             RouterMetrics())
        await lenient.refresh()
        assert set(lenient.known) == {"fresh", "replayed", "future"}
        await lenient.close()
    finally:
        await replicas.close()


async def test_the_publisher_signs_with_the_env_token_and_the_router_accepts_it(
        redis_server, monkeypatch):
    monkeypatch.setenv(REGISTRATION_TOKEN_ENV, "shared")
    pub = PrefixIndexPublisher(redis_server.url, "svc", "p1", "http://p1:8000", "tiny", 16,
                               heartbeat_interval=0.1)
    cfg = RouterConfig(redis_url=redis_server.url, service_name="svc",
                       registration_token="shared")
    replicas = ReplicaSet(cfg, RouterMetrics())
    await pub.start()
    try:
        for _ in range(100):
            await replicas.refresh()
            if "p1" in replicas.known:
                break
            await asyncio.sleep(0.05)
        assert "p1" in replicas.known
        stored = redis.Redis.from_url(redis_server.url).hgetall(KEYS.replica("p1"))
        assert len(stored[SIGNATURE_FIELD.encode()]) == 64
        wrong = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc",
                                        registration_token="other"), RouterMetrics())
        await wrong.refresh()
        assert wrong.known == {} and wrong.ignored == {"p1"}
        await wrong.close()
    finally:
        await pub.close()
        await replicas.close()


async def test_a_draining_replica_is_not_routed(redis_server):
    r = redis.Redis.from_url(redis_server.url)
    register(r, "up", good_beat("up"))
    register(r, "leaving", good_beat("leaving", **{DRAINING_FIELD: DRAINING_VALUE}))
    replicas = ReplicaSet(RouterConfig(redis_url=redis_server.url, service_name="svc"),
                          RouterMetrics())
    try:
        await replicas.refresh()
        assert set(replicas.known) == {"up"} and replicas.ignored == {"leaving"}
        assert [m.replica.replica_id for m in await replicas.lookup(CHAIN)] == ["up"]
        r.hset(KEYS.replica("leaving"), DRAINING_FIELD, "0")  # back (e.g. a cancelled drain)
        await replicas.refresh()
        assert set(replicas.known) == {"up", "leaving"}
    finally:
        await replicas.close()


@pytest.fixture
def redis_with_password(redis_server):
    """The fixture's redis-server, now requiring a password."""
    redis.Redis.from_url(redis_server.url).config_set("requirepass", "pa:ss@word")
    return redis_server


async def test_the_password_comes_from_the_env_when_the_url_has_none(redis_with_password,
                                                                     monkeypatch):
    url = redis_with_password.url
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)
    index = PrefixIndex.from_url(url, "svc")
    with pytest.raises(redis.exceptions.AuthenticationError):
        await index.scan()
    await index.close()
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "pa:ss@word")
    index = PrefixIndex.from_url(url, "svc")
    assert (await index.scan()).matches == []
    await index.close()
    # A password in the URL wins over the environment.
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "wrong")
    in_url = url.replace("redis://", "redis://:pa%3Ass%40word@")
    index = PrefixIndex.from_url(in_url, "svc")
    assert (await index.scan()).matches == []
    await index.close()
    # The publisher too.
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "pa:ss@word")
    pub = PrefixIndexPublisher(url, "svc", "p", "http://p:1", "tiny", 16, heartbeat_interval=0.1)
    await pub.start()
    try:
        for _ in range(100):
            if pub.connected:
                break
            await asyncio.sleep(0.05)
        assert pub.connected
    finally:
        await pub.close()


def test_redact_url_hides_credentials_in_any_scheme():
    assert redact_url("redis://user:pw@h:6379/0") == "redis://***@h:6379/0"
    assert redact_url("rediss://:pw@h/1") == "rediss://***@h/1"
    assert redact_url("redis+sentinel://u:p@a:1,b:2/m") == "redis+sentinel://***@a:1,b:2/m"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url(None) == "-"


def test_the_router_never_logs_the_redis_password(tmp_path):
    """The router process's own log, with a password in --redis-url and nothing listening."""
    import sys

    from conftest import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service.router", "--host", "127.0.0.1", "--port",
         str(port), "--redis-url", f"redis://admin:hunter2@127.0.0.1:{free_port()}/0",
         "--policy", "least-load", "--log-level", "debug"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import httpx
        from conftest import wait_for

        def redis_errors() -> float:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
            except httpx.HTTPError:
                return 0.0
            return next((float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("kvserve_router:redis_errors_total ")), 0.0)

        # Two refreshes failed against the missing Redis (and logged whatever they log).
        wait_for(lambda: redis_errors() >= 2, 60, "two failed Redis refreshes")
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "redis://***@127.0.0.1" in out, out
    assert "hunter2" not in out, out


# Edges the mutation run found untested (docs/mutation.md).

async def test_replica_ids_up_to_a_dns_name_are_accepted_and_unprintable_ones_are_not(
        redis_server):
    r = redis.Redis.from_url(redis_server.url)
    longest, too_long, newline = "r" * 253, "r" * 254, "a\nb"
    for rid in (longest, too_long, newline):
        register(r, rid, good_beat(rid))
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        scan = await index.scan(CHAIN)
        assert [m.replica.replica_id for m in scan.matches] == [longest]
        assert {rid for rid, _ in scan.malformed} == {too_long, newline}
    finally:
        await index.close()


async def test_a_lookup_walks_at_most_max_lookup_blocks(redis_server):
    from kvserve.service.prefix_index.lookup import MAX_LOOKUP_BLOCKS

    chain = block_hashes(list(range(16 * (MAX_LOOKUP_BLOCKS + 1))), 16)
    r = redis.Redis.from_url(redis_server.url)
    register(r, "long", good_beat("long"), blocks=chain)
    index = PrefixIndex.from_url(redis_server.url, "svc")
    try:
        assert await index.match_counts(chain) == {"long": MAX_LOOKUP_BLOCKS}
        assert [m.matched_blocks for m in await index.lookup(chain)] == [MAX_LOOKUP_BLOCKS]
    finally:
        await index.close()
