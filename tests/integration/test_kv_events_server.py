"""A real server publishing vLLM-format KV events (--kv-events-config): what a llm-d / GIE
scheduler's subscriber sees, decoded with a decoder written from vLLM's definition."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import free_port
from server_thread import ServerThread
from vllm_kv_events import decode_batch, receive, replay, subscribe

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_hash import block_hashes_bytes
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

BLOCKS = 16  # a small pool: a few distinct prompts evict earlier ones
PROMPT_BLOCKS = 4  # 64-token prompts


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[dict[str, Any]]:
    port, replay_port = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
              "topic": "kvserve"}
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_model_len=128, max_num_seqs=2,
        num_gpu_blocks_override=BLOCKS, kv_events_config=json.dumps(events)))
    srv = ServerThread(create_app(engine, ServerConfig(served_model_names=["tiny"]))).start()
    sub = subscribe(f"tcp://127.0.0.1:{port}", b"kvserve")
    yield {"server": srv, "sub": sub, "replay": f"tcp://127.0.0.1:{replay_port}"}
    sub.close(linger=0)
    srv.stop()


def prompt(k: int) -> list[int]:
    """A prompt of PROMPT_BLOCKS full blocks that shares no block with prompt(j), j != k."""
    return [10 + k] + [20 + (k * 7 + i) % 200 for i in range(16 * PROMPT_BLOCKS - 1)]


def complete(url: str, tokens: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": tokens, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def events_of(payloads: list[bytes]) -> list[dict[str, Any]]:
    return [e for p in payloads for e in decode_batch(p)["events"]]


def test_stored_blocks_match_the_prompt_and_arrive_in_sequence(served):
    url, sub = served["server"].url, served["sub"]
    live = None
    k = 0
    while live is None:  # a SUB socket sees nothing sent before it joined: send until it does
        complete(url, prompt(k))
        live = receive(sub, 2000)
        k += 1
    complete(url, prompt(k))
    later = receive(sub, 30_000)
    assert later is not None and later[0] == b"kvserve" and later[1] > live[1]
    # The replay socket holds every batch from the first: the subscriber's gaps filled.
    buffered = replay(served["replay"], 0)
    seqs = [s for s, _ in buffered]
    assert seqs == list(range(len(seqs))) and later[1] in seqs
    assert dict(buffered)[later[1]] == later[2]
    stored = [e for e in events_of([p for _, p in buffered]) if e["type"] == "BlockStored"]
    for j in range(k + 1):
        tokens = prompt(j)
        hashes = block_hashes_bytes(tokens, 16)  # what the engine and the router compute
        mine = [e for e in stored if e["block_hashes"][0] == hashes[0]]
        assert len(mine) == 1, f"prompt {j}: one BlockStored for its chain"
        assert mine[0]["block_hashes"] == hashes
        assert mine[0]["parent_block_hash"] is None
        assert mine[0]["token_ids"] == tokens[:16 * len(hashes)]
        assert mine[0]["block_size"] == 16 and mine[0]["medium"] == "GPU"


def test_evicted_blocks_are_announced_removed(served):
    url = served["server"].url
    for k in range(100, 100 + BLOCKS // PROMPT_BLOCKS + 2):  # more prompts than the pool holds
        complete(url, prompt(k))
    complete(url, prompt(300))  # one more step after the evictions, to publish them surely
    events = events_of([p for _, p in replay(served["replay"], 0)])
    stored = {h for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and set(removed) <= stored
    first = block_hashes_bytes(prompt(100), 16)
    assert set(first) <= set(removed)  # LRU: the oldest prompt's blocks went first
    assert all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")


@pytest.mark.slow
def test_the_cli_flag_publishes_from_a_server_with_its_engine_core_in_a_process(
        tiny_model_dir, tmp_path):
    # `kvserve serve --kv-events-config` with the engine core in its own process (the default):
    # the events cross to the API process, whose observer publishes them.
    from server_process import api_server_process

    port = free_port()
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    with api_server_process(tiny_model_dir, tmp_path / "log", "--kv-events-config", config,
                            engine_core="process") as (_, url):
        sub = subscribe(f"tcp://127.0.0.1:{port}")
        try:
            got, k = None, 0
            while got is None:
                complete(url, prompt(k))
                got = receive(sub, 2000)
                k += 1
            (event,) = [e for e in decode_batch(got[2])["events"] if e["type"] == "BlockStored"]
            assert event["block_hashes"] == block_hashes_bytes(prompt(k - 1), 16)
            assert event["token_ids"] == prompt(k - 1)
        finally:
            sub.close(linger=0)
