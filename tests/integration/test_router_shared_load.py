"""Routers of one service share their in-flight counts through a real Redis
(service/router/shared_load.py), so each one's load view includes the others' requests."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import redis.asyncio as aioredis
from kvserve.service.prefix_index.replica_info import ReplicaInfo
from kvserve.service.router.cli import add_arguments, config_from_args
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.shared_load import SharedInflight

R1 = ReplicaInfo("r1", "http://127.0.0.1:1", "m", 16, num_running=1)


async def until(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_router_sees_the_other_routers_requests_in_flight(redis_server):
    cfg = RouterConfig(redis_url=redis_server.url, service_name="svc", shared_load_interval=0.05)
    a, b = ReplicaSet(cfg, RouterMetrics()), ReplicaSet(cfg, RouterMetrics())
    await a.start()
    await b.start()
    try:
        assert b.candidate(R1, 0).load == 1  # the heartbeat's load, nothing in flight
        for _ in range(3):
            a.acquire("r1")
        b.acquire("r1")
        await until(lambda: b.shared.others.get("r1") == 3 and a.shared.others.get("r1") == 1)
        assert b.candidate(R1, 0).load == 4  # its own 1 + the other router's 3
        assert a.candidate(R1, 0).load == 4
        for _ in range(3):
            a.release("r1")
        await until(lambda: not b.shared.others.get("r1"))
        assert b.candidate(R1, 0).load == 1
    finally:
        await a.close()
        await b.close()
    # A router that closes leaves the set at once.
    client = aioredis.Redis.from_url(redis_server.url)
    assert await client.scard("kvserve:{svc}:routers") == 0
    await client.aclose()


async def test_a_dead_routers_counts_expire(redis_server):
    client = aioredis.Redis.from_url(redis_server.url)
    dead = SharedInflight(client, "svc", {"r1": 5}, interval=0.05, ttl=0.3, rid="dead")
    dead.start()
    alive = SharedInflight(client, "svc", {}, interval=0.05, rid="alive")
    alive.start()
    try:
        await until(lambda: alive.others.get("r1") == 5)
        dead._task.cancel()  # killed: no close, its hash just stops being refreshed
        await asyncio.gather(dead._task, return_exceptions=True)
        await until(lambda: "r1" not in alive.others)
        assert await client.sismember("kvserve:{svc}:routers", "dead") == 0
    finally:
        await alive.close()
        await client.aclose()


def test_the_flag_turns_it_off_and_refuses_negative_values():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--redis-url", "redis://x", "--shared-load-interval",
                                         "0"]))
    assert ReplicaSet(cfg, RouterMetrics()).shared is None
    with pytest.raises(SystemExit, match="--shared-load-interval"):
        config_from_args(p.parse_args(["--shared-load-interval", "-1"]))
