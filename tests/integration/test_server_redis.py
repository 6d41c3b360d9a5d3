"""A replica started with --redis-url publishes its prefix-cache block hashes and its load to a real
Redis, under the keys the router reads, and removes them when it shuts down."""

from __future__ import annotations

import httpx
import redis
from conftest import wait_for
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.publishing import make_publisher

SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 4


def test_replica_publishes_block_hashes_and_load(tiny_model_dir, redis_server):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=256,
                                                kv_cache_memory=4 << 20))
    config = ServerConfig(served_model_names=["tiny"], redis_url=redis_server.url,
                          service_name="svc", replica_id="r1", advertise_url="http://r1:8000")
    publisher = make_publisher(config, "tiny", engine.block_size)
    srv = ServerThread(create_app(engine, config, publisher)).start()
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        wait_for(lambda: r.hget("kvserve:{svc}:replica:r1", "url") == "http://r1:8000",
                 what="the replica's heartbeat")
        info = r.hgetall("kvserve:{svc}:replica:r1")
        assert info["model"] == "tiny" and info["block_size"] == "16"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": messages, "max_tokens": 2})
        assert resp.status_code == 200
        ids = httpx.post(srv.url + "/tokenize", json={"messages": messages}).json()["tokens"]
        expected = block_hashes(ids, 16)  # what the router computes for this prompt
        assert len(expected) >= 3
        wait_for(lambda: set(expected) <= r.smembers("kvserve:{svc}:blocks:r1"),
                 what="the prompt's block hashes in Redis")
    finally:
        srv.stop()
    assert not r.exists("kvserve:{svc}:replica:r1")  # removed on shutdown
    assert not r.sismember("kvserve:{svc}:replicas", "r1")
