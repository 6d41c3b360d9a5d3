"""`--redis-url` for every component: single Redis, Sentinel and Cluster URLs, the password from
the URL or KVSERVE_REDIS_PASSWORD, and clear startup errors that never show the password."""

from __future__ import annotations

import argparse

import pytest
from redis.asyncio.cluster import RedisCluster

from kvserve.service import cli
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.redis_client import (REDIS_PASSWORD_ENV, SentinelMasterRedis,
                                                       async_redis, parse_redis_url)
from kvserve.service.router import cli as router_cli


def test_sentinel_url_names_hosts_master_and_password():
    t = parse_redis_url("redis+sentinel://:p%40ss@s1:26379,s2,[::1]:26380/mymaster")
    assert t.kind == "sentinel" and t.master == "mymaster" and t.password == "p@ss"
    assert t.hosts == (("s1", 26379), ("s2", 26379), ("::1", 26380))  # 26379 by default


def test_cluster_url_names_startup_nodes():
    t = parse_redis_url("redis+cluster://user:pw@n1:7000,n2:7001")
    assert t.kind == "cluster" and t.master is None
    assert t.hosts == (("n1", 7000), ("n2", 7001)) and (t.username, t.password) == ("user", "pw")
    assert parse_redis_url("redis+cluster://n1").hosts == (("n1", 6379),)
    assert parse_redis_url("redis+cluster://n1:7000/0").kind == "cluster"


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://:pw@h:6380/1",
                                 "unix:///run/redis.sock"])
def test_single_server_urls_are_left_to_redis_py(url):
    assert parse_redis_url(url).kind == "single"


@pytest.mark.parametrize("url, why", [
    ("http://:hunter2@h:6379", "unknown scheme 'http'"),
    ("h:6379", "unknown scheme '(none)'"),
    ("redis://:hunter2@h:port/0", "bad port"),
    ("redis://:hunter2@h:70000/0", "bad port"),
    ("redis://", "no host"),
    ("redis://:hunter2@h:6379/mymaster", "the database after the host must be a number"),
    ("redis+sentinel://:hunter2@s1:26379,s2:26379", "name the Sentinel master set"),
    ("redis+sentinel://s1:26379/a/b", "name the Sentinel master set"),
    ("redis+sentinel:///mymaster", "no hosts"),
    ("redis+sentinel://:hunter2@s1:x/mymaster", "bad port 'x'"),
    ("redis+sentinel://s1:0/mymaster", "bad port '0'"),
    ("redis+cluster://", "no hosts"),
    ("redis+cluster://:hunter2@n1:7000,,n2:7001", "an empty entry"),
    ("redis+cluster://n1:7000/2", "only database 0"),
    ("redis+cluster://n1:7000?timeout=1", "no ?query"),
    ("redis+cluster://n1:7000?sentinel_auth=false", "no ?query"),
    ("redis+sentinel://s1/m?sentinel_auth=maybe", "the only query option is ?sentinel_auth"),
    ("redis+sentinel://s1/m?sentinel_auth=false&db=2", "the only query option"),
    ("redis+sentinel://s1/m#frag", "no #fragment"),
])
def test_bad_urls_name_the_flag_and_hide_the_password(url, why):
    with pytest.raises(ValueError) as err:
        parse_redis_url(url)
    message = str(err.value)
    assert message.startswith("--redis-url '") and why in message
    assert "hunter2" not in message


async def test_cluster_client_gets_the_startup_nodes_and_the_env_password(monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "from-env")
    client = async_redis("redis+cluster://n1:7000,n2:7001", timeout=0.5)
    try:
        assert isinstance(client, RedisCluster)
        nodes = {(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()}
        assert nodes == {("n1", 7000), ("n2", 7001)}
        assert client.nodes_manager.connection_kwargs["password"] == "from-env"
    finally:
        await client.aclose()


async def test_sentinel_client_authenticates_to_sentinels_and_primary(monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "from-env")
    client = async_redis("redis+sentinel://:from-url@s1:1,s2:2/mymaster", timeout=0.5)
    try:
        assert isinstance(client, SentinelMasterRedis)
        pool = client.connection_pool
        assert pool.service_name == "mymaster"
        assert pool.connection_kwargs["password"] == "from-url"  # the URL wins over the env
        sentinels = pool.sentinel_manager.sentinels
        assert [(s.connection_pool.connection_kwargs["host"],
                 s.connection_pool.connection_kwargs["port"]) for s in sentinels] == \
            [("s1", 1), ("s2", 2)]
        assert all(s.connection_pool.connection_kwargs["password"] == "from-url"
                   for s in sentinels)
        assert pool.connection_kwargs["socket_timeout"] == 0.5
    finally:
        await client.aclose()


async def test_sentinels_without_a_password_of_their_own(monkeypatch):
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "data-only")
    assert parse_redis_url("redis+sentinel://s1/m?sentinel_auth=false").sentinel_auth is False
    assert parse_redis_url("redis+sentinel://s1/m?sentinel_auth=yes").sentinel_auth is True
    client = async_redis("redis+sentinel://s1:1/mymaster?sentinel_auth=false", timeout=0.5)
    try:
        assert client.connection_pool.connection_kwargs["password"] == "data-only"
        sentinel = client.connection_pool.sentinel_manager.sentinels[0]
        assert sentinel.connection_pool.connection_kwargs.get("password") is None
    finally:
        await client.aclose()


def test_service_keys_share_one_cluster_slot_and_services_differ():
    from redis.crc import key_slot

    keys = IndexKeys("llama")
    # Any key built on the prefix, whatever the layout adds, lands in the service's slot.
    slots = {key_slot(k.encode()) for k in (keys.replicas, keys.replica("r1"),
                                            keys.prefix + "blocks:r1", keys.prefix + "any:x")}
    assert len(slots) == 1
    assert slots != {key_slot(IndexKeys("mistral").replicas.encode())}


def test_serve_refuses_a_bad_url_before_loading_the_model(capsys):
    code = cli.main(["serve", "/nonexistent/model", "--redis-url",
                     "redis+sentinel://:hunter2@s1:26379"])
    err = capsys.readouterr().err
    assert code == 2 and "configuration error: --redis-url" in err and "MASTER_NAME" in err
    assert "hunter2" not in err


def test_router_refuses_a_bad_url_at_startup():
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as err:
        router_cli.config_from_args(parser.parse_args(["--redis-url", "redis+cluster://:pw@"]))
    assert "--redis-url 'redis+cluster://***@': no hosts" in str(err.value)
    ok = router_cli.config_from_args(parser.parse_args(["--redis-url", "redis+cluster://n:1"]))
    assert ok.redis_url == "redis+cluster://n:1"


@pytest.mark.parametrize("name", ["", "a{b}"])
def test_a_service_name_that_cannot_be_a_hash_tag_is_refused_at_startup(name, capsys):
    code = cli.main(["serve", "/nonexistent/model", "--redis-url", "redis://r:6379/0",
                     "--service-name", name])
    assert code == 2 and "configuration error: --service-name" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="--service-name"):
        router_cli.config_from_args(parser.parse_args(["--redis-url", "redis://r:6379/0",
                                                       "--service-name", name]))
