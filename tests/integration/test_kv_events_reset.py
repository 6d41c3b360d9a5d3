"""vLLM's dev route POST /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1) on a real server that
publishes vLLM-format KV events: the subscriber sees AllBlocksCleared, and a prompt cached before
the reset is computed and stored again after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import free_port
from server_thread import ServerThread
from vllm_kv_events import decode_batch, replay

from kvserve.engine.config import EngineConfig
from kvserve.engine.core.block_hash import block_hashes_bytes
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

PROMPT = [11] + [20 + i % 200 for i in range(63)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[dict[str, Any]]:
    replay_port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{free_port()}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kvserve"}
    engine = LLMEngine.from_config(EngineConfig(
        model=str(tiny_model_dir), dtype="float32", max_model_len=128, max_num_seqs=2,
        num_gpu_blocks_override=32, kv_events_config=json.dumps(events)))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # read when the app is built, as vLLM does
        app = create_app(engine, ServerConfig(served_model_names=["tiny"]))
    srv = ServerThread(app).start()
    yield {"url": srv.url, "replay": f"tcp://127.0.0.1:{replay_port}"}
    srv.stop()


def complete(url: str) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_reset_prefix_cache_publishes_all_blocks_cleared_and_forgets_the_prompt(served):
    url = served["url"]
    complete(url)
    complete(url)  # a prefix hit: its blocks are not stored twice
    r = httpx.post(url + "/reset_prefix_cache", params={"reset_running_requests": "false"})
    assert r.status_code == 200 and r.content == b""  # vLLM's empty 200
    complete(url)  # recomputed: stored again, and its step publishes the reset before it
    events = [e for _, p in replay(served["replay"], 0) for e in decode_batch(p)["events"]]
    first = block_hashes_bytes(PROMPT, 16)[0]
    kinds = [e["type"] for e in events
             if e["type"] == "AllBlocksCleared" or first in e.get("block_hashes", [])]
    assert kinds == ["BlockStored", "AllBlocksCleared", "BlockStored"]
