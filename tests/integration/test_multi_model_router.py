"""A several-model replica behind the router, on real parts (a redis-server, the server and the
router as processes): the heartbeat lists the additional model, the router sends its requests to
the replica through the adapter-affinity path, and the blocks that model caches in the shared
pool are the ones the router predicts (its hashes carry the model's name, as the engine's do)."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from conftest import build_tiny_llama, free_port, wait_for
from server_process import api_server_process

from test_multi_model import build_tiny_qwen3

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14] * 6  # three full blocks of 16


@pytest.fixture
def stack(tmp_path, redis_server, monkeypatch):
    monkeypatch.delenv("KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING", raising=False)
    qwen = build_tiny_qwen3(tmp_path / "qwen")
    llama = build_tiny_llama(tmp_path / "llama")
    with api_server_process(qwen, tmp_path / "server.log", "--additional-model",
                            f"llama={llama}", "--redis-url", redis_server.url,
                            "--service-name", "mm") as (_, server):
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "kvserve.service.router", "--host", "127.0.0.1", "--port",
             str(port), "--redis-url", redis_server.url, "--service-name", "mm",
             "--tokenizer", str(qwen), "--expose-routing-headers", "--log-level", "warning"],
            stdout=(tmp_path / "router.log").open("w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            yield server, url
        finally:
            router.kill()
            router.wait()


def replicas(router: str) -> list[dict]:
    try:
        return httpx.get(router + "/health", timeout=5).json().get("replicas", [])
    except (httpx.TransportError, ValueError):
        return []


def test_the_router_sends_each_model_to_the_replica_that_serves_it(stack):
    server, router = stack
    wait_for(lambda: any(r["adapters"] == ["llama"] for r in replicas(router)), 60,
             "the replica's heartbeat listing its additional model")
    body = {"model": "llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    direct = httpx.post(server + "/v1/completions", json=body, timeout=60).json()
    first = httpx.post(router + "/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    # The replica has published llama's blocks (model-keyed); the router's own hashes of the
    # same prompt for model "llama" find them.
    wait_for(lambda: int(httpx.post(router + "/v1/completions", json=body, timeout=60)
                         .headers.get("x-kvserve-predicted-matched-tokens", 0)) >= 32, 30,
             "the router predicting llama's cached prefix")
    # without KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING the runtime endpoints do not exist
    refused = httpx.post(server + "/v1/load_model", timeout=10,
                         json={"model_name": "x", "model_path": "/nowhere"})
    assert refused.status_code == 404
    other = dict(body, model="tiny")  # the same tokens for the first model: nothing cached yet
    assert int(httpx.post(router + "/v1/completions", json=other, timeout=60)
               .headers.get("x-kvserve-predicted-matched-tokens", 0)) == 0
