"""A several-model replica behind the router, on real parts (a redis-server; the server as
`kvserve serve --additional-model` builds it, and the router, each on a thread of the test
process rather than a process of its own: a process start is 20 s of imports on two busy cores,
and tests/integration/test_multi_model.py runs that server as a process): the heartbeat lists
the additional model, the router sends its requests to the replica through the adapter-affinity
path, and the blocks that model caches in the shared pool are the ones the router predicts (its
hashes carry the model's name, as the engine's do)."""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
import uvicorn
from conftest import build_tiny_llama, free_port, wait_for

from kvserve.service.serve_args import (build_serve_parser, engine_config_from_args,
                                        server_config_from_args)
from kvserve.service.server.drain import DrainingServer
from kvserve.service.server.multi_model import AllEngines, multi_model_app

from test_multi_model import build_tiny_qwen3
from test_router import RouterThread

PROMPT = [7, 8, 9, 10, 11, 12, 13, 14] * 6  # three full blocks of 16


@pytest.fixture
def stack(tmp_path, redis_server, monkeypatch):
    monkeypatch.delenv("KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING", raising=False)
    qwen = build_tiny_qwen3(tmp_path / "qwen")
    llama = build_tiny_llama(tmp_path / "llama")
    port = free_port()
    args = build_serve_parser().parse_args([
        str(qwen), "--additional-model", f"llama={llama}", "--redis-url", redis_server.url,
        "--service-name", "mm", "--served-model-name", "tiny", "--host", "127.0.0.1", "--port",
        str(port), "--kv-cache-memory", "4MiB", "--dtype", "float32", "--device", "cpu"])
    # what api_server.run_multi_server serves, on a thread
    app, apps = multi_model_app(engine_config_from_args(args), server_config_from_args(args))
    server = DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"),
                            AllEngines(apps), 1.0)  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, name="multi-model-server", daemon=True)
    router = None
    try:
        thread.start()
        router = RouterThread(qwen, redis_server.url, ("--service-name", "mm"))
        wait_for(lambda: server.started or not thread.is_alive(), 60, "the server")
        assert thread.is_alive(), "the server did not start (see the log above)"
        router.wait()
        yield f"http://127.0.0.1:{port}", router.url
    finally:
        if router is not None:
            router.stop()
        server.handle_exit(signal.SIGTERM, None)
        thread.join(30)
        apps.models.shutdown()


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
