"""Opening Redis the same way in every component, from one `--redis-url`: a single server
(`redis://`, `rediss://`, `unix://`), a Sentinel-managed primary
(`redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME`) or a Redis Cluster
(`redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...]`). The password comes from the URL or, when
the URL has none, from `KVSERVE_REDIS_PASSWORD` (a Kubernetes Secret); with Sentinel it is sent to
the sentinels too (Bitnami's `auth.sentinel: true`) unless the URL ends in `?sentinel_auth=false`
(sentinels without a password). URLs are redacted before logging.

Under Cluster a service's keys share one slot (the `{service}` hash tag in keys.py), so the index's
Lua scripts run on the one node that owns it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.asyncio.sentinel import Sentinel

REDIS_PASSWORD_ENV = "KVSERVE_REDIS_PASSWORD"
SINGLE_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
SCHEMES = (*SINGLE_SCHEMES, SENTINEL_SCHEME, CLUSTER_SCHEME)
DEFAULT_PORTS = {SENTINEL_SCHEME: 26379, CLUSTER_SCHEME: 6379}

# user:pass@ or :pass@ after the scheme, in any URL inside a log line.
_CREDENTIALS = re.compile(r"(?P<scheme>[a-z][a-z0-9+.\-]*://)[^/@\s]*@", re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` with any user:password@ replaced by ***@ (for log lines and errors)."""
    if not url:
        return "-"
    return _CREDENTIALS.sub(lambda m: m.group("scheme") + "***@", url)


def password_from_env(url: str) -> str | None:
    """The env password, used only when the URL carries none (the URL wins)."""
    if urlsplit(url).password:
        return None
    return os.environ.get(REDIS_PASSWORD_ENV) or None


@dataclass(frozen=True)
class RedisTarget:
    """What a `--redis-url` names: `kind` is "single", "sentinel" or "cluster"; `hosts` and
    `master` are set for the last two (the single kind is left to redis-py's own parser)."""

    kind: str
    url: str
    hosts: tuple[tuple[str, int], ...] = ()
    master: str | None = None
    username: str | None = None
    password: str | None = None
    sentinel_auth: bool = True  # send the password to the sentinels too


def parse_redis_url(url: str, flag: str = "--redis-url") -> RedisTarget:
    """The target of `url`; ValueError naming `flag` and the redacted URL when it cannot work."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{flag} {redact_url(url)!r}: {why}")

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise bad(f"unknown scheme {scheme or '(none)'!r}; use one of "
                  + ", ".join(f"{s}://" for s in SCHEMES))
    parts = urlsplit(url)
    if scheme in SINGLE_SCHEMES:
        try:
            parts.port  # noqa: B018 - raises ValueError on a non-numeric or out-of-range port
        except ValueError as exc:
            raise bad(f"bad port ({exc})") from None
        if scheme != "unix" and not parts.hostname:
            raise bad("no host")
        if scheme != "unix" and not parts.path.strip("/").isdigit() and parts.path.strip("/"):
            raise bad(f"the database after the host must be a number, not {parts.path!r}")
        return RedisTarget("single", url)
    sentinel_auth = _sentinel_auth(scheme, parts.query, bad)
    if parts.fragment:
        raise bad(f"{scheme}:// takes no #fragment")
    netloc = parts.netloc.rpartition("@")[2]
    if not netloc:
        raise bad("no hosts")
    hosts = tuple(_host_port(h, DEFAULT_PORTS[scheme], bad) for h in netloc.split(","))
    path = parts.path.strip("/")
    master = None
    if scheme == SENTINEL_SCHEME:
        if not path or "/" in path:
            raise bad("name the Sentinel master set after the hosts: "
                      "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME")
        master = unquote(path)
    elif path and path != "0":
        raise bad("Redis Cluster has only database 0; "
                  "use redis+cluster://HOST:PORT[,HOST:PORT...]")
    return RedisTarget("sentinel" if master else "cluster", url, hosts, master,
                       unquote(parts.username) if parts.username else None,
                       unquote(parts.password) if parts.password else None, sentinel_auth)


def _sentinel_auth(scheme: str, query: str, bad: Any) -> bool:
    """`?sentinel_auth=false` (redis+sentinel:// only): sentinels that have no password of their
    own (the data nodes still get it); the only query option."""
    if not query:
        return True
    options = parse_qs(query, keep_blank_values=True)
    value = options.pop("sentinel_auth", [""])[-1].lower()
    if scheme != SENTINEL_SCHEME or options or value not in _BOOLS:
        raise bad(f"{scheme}:// takes no ?query" if scheme != SENTINEL_SCHEME else
                  "the only query option is ?sentinel_auth=true|false")
    return _BOOLS[value]


_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _host_port(item: str, default_port: int, bad: Any) -> tuple[str, int]:
    """One HOST[:PORT] of a multi-host URL ([v6addr]:PORT too)."""
    item = item.strip()
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = item.rpartition(":") if ":" in item else (item, "", "")
    if not host:
        raise bad(f"no host in {item!r}" if item else "an empty entry in the host list")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"bad port {port_text!r} in {item!r}")
    return host, int(port_text)


class SentinelMasterRedis(aioredis.Redis):
    """The primary of a Sentinel master set (failover-aware: each new connection asks the
    sentinels where the primary is); closing it also closes the sentinel connections."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in self.connection_pool.sentinel_manager.sentinels:
            await sentinel.aclose()


def async_redis(url: str, timeout: float, **kwargs: Any) -> aioredis.Redis | RedisCluster:
    """An asyncio client for `url` (any of SCHEMES) with the env password applied; ValueError
    when the URL cannot work. Socket timeouts are `timeout` seconds."""
    target = parse_redis_url(url)
    password = target.password or password_from_env(url)
    timeouts = {"socket_timeout": timeout, "socket_connect_timeout": timeout}
    if target.kind == "single":
        if password is not None:
            kwargs["password"] = password
        return aioredis.Redis.from_url(url, **timeouts, **kwargs)
    auth = {k: v for k, v in (("username", target.username), ("password", password)) if v}
    if target.kind == "cluster":
        # One immediate retry (after the slot map's refresh), not redis-py's ten with backoff:
        # those hold a routing decision for seconds while a master fails over, where the router
        # should answer by load at once; its refresh and the publisher retry every second anyway.
        kwargs.setdefault("retry", Retry(NoBackoff(), 1))
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        return RedisCluster(startup_nodes=nodes, **auth, **timeouts, **kwargs)
    sentinel_auth = auth if target.sentinel_auth else {}
    sentinel = Sentinel(list(target.hosts), sentinel_kwargs={**sentinel_auth, **timeouts},
                        **auth, **timeouts, **kwargs)
    assert target.master is not None
    return sentinel.master_for(target.master, redis_class=SentinelMasterRedis)
