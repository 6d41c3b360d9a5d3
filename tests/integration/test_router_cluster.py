"""End to end on Redis Cluster: two real `kvserve serve` replica processes and a real router
process, all given the same `redis+cluster://` URL (three masters, the service's keys on one
slot by its hash tag). The router routes a repeated prompt to the replica that cached it, and
that replica reports the hit in usage."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
from conftest import free_port
from redis_topology import RedisClusterSet
from test_router import (HEADERS_FLAG, ROUTER_FLAGS, TENANT_PROMPTS, chat, chat_body, spawn,
                         spawn_replica, wait_healthy, wait_until)

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.service.router.prompt_tokens import prompt_tokens_for

pytestmark = pytest.mark.slow  # three processes and a Redis Cluster on 2 busy cores


@pytest.fixture
def cluster_fleet(tiny_model_dir, tmp_path):
    topology = RedisClusterSet(tmp_path, masters=3)
    procs = []
    try:
        url = topology.start().url
        assert url.startswith("redis+cluster://")
        procs += [spawn_replica(rid, tiny_model_dir, url, tmp_path) for rid in ("c1", "c2")]
        port = free_port()
        router = spawn("router", ["kvserve.service.router", "--host", "127.0.0.1", "--port",
                                  str(port), "--redis-url", url, "--tokenizer",
                                  str(tiny_model_dir), *ROUTER_FLAGS, HEADERS_FLAG],
                       port, tmp_path)
        procs.append(router)
        deadline = time.monotonic() + 540  # three processes start on a busy machine
        for p in procs:
            wait_healthy(p, deadline)
        wait_until(lambda: len(httpx.get(router.url + "/health").json()["replicas"]) == 2,
                   what="the router seeing both replicas through the Cluster")
        yield router, load_tokenizer(tiny_model_dir)
    finally:
        for p in procs:
            p.proc.send_signal(signal.SIGKILL)
            p.proc.wait()
        topology.stop()


@pytest.mark.timeout(1200)  # the fixture alone may wait 540 s for three processes
def test_prefix_routing_through_a_redis_cluster(cluster_fleet):
    router, tokenizer = cluster_fleet
    body = chat_body(TENANT_PROMPTS[1], "through the cluster")
    blocks = len(block_hashes(prompt_tokens_for(tokenizer, "/v1/chat/completions", body), 16))
    assert blocks >= 3
    first = chat(router.url, body)
    holder = first.headers["x-kvserve-replica"]
    # Once the holder's publisher has written its blocks to the Cluster, the router predicts
    # the whole prefix there, and the replica serves it from its cache.
    wait_until(lambda: int(chat(router.url, body).headers[
        "x-kvserve-predicted-matched-tokens"]) == blocks * 16, what="prefix routing via Cluster")
    again = chat(router.url, body)
    assert again.headers["x-kvserve-replica"] == holder
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
