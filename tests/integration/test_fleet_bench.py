"""The fleet benchmark's harness in a small configuration: real redis-server, real `kvserve
router` processes, 8 simulated replicas (service/sim/) in this process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("fleet_bench", ROOT / "bench" / "fleet.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    path = tmp_path / "tok"
    build_tiny_tokenizer().save_pretrained(path)
    (path / "config.json").write_text('{"model_type": "llama"}')  # a model folder to the router
    return path


@pytest.mark.slow  # two router processes start: ~50 s on a loaded 2-core machine
async def test_prefix_routing_beats_round_robin_on_a_simulated_fleet(redis_binary, tmp_path,
                                                                   tokenizer_dir):
    fleet = load_bench()
    timing = fleet.timing_model("h100-llama3-8b").scaled(2.0, num_blocks=256)
    workload = fleet.Workload(tenants=4, system_tokens=256, users_per_tenant=2, turns=3,
                              user_tokens=32, max_tokens=4)
    cfg = fleet.FleetConfig(8, timing, workload, qps=[12.0],
                            policies=["prefix", "round-robin", "oracle"], requests=36,
                            warmup_requests=6, tokenizer=str(tokenizer_dir))
    results = {r.policy: r for r in await fleet.run_fleet(cfg, tmp_path, verbose=False)}
    for r in results.values():
        # A fixed count of requests, not a wall-clock window: the same work on any machine.
        assert r.sent == 36 and r.errors == 0 and r.completed == r.sent, r
        assert r.ttft_p50 > 0
    prefix, rr, oracle = results["prefix"], results["round-robin"], results["oracle"]
    # 4 tenants on 8 replicas: round robin spreads each tenant over every replica, so its later
    # requests mostly miss; prefix routing sends a tenant back to where its prompt is cached.
    assert prefix.hit_rate > rr.hit_rate + 0.2, (prefix.hit_rate, rr.hit_rate)
    assert oracle.hit_rate > rr.hit_rate
    # The router asked Redis once per request, and the index holds the replicas' keys.
    assert prefix.lookups_s > 0 and prefix.index_keys >= 8
    assert prefix.decision_p99_ms > 0


async def test_simulated_replicas_serve_the_openai_api(tokenizer_dir):
    """Chat (streamed and whole) and completions on two replicas of one fleet, no Redis; the
    second identical chat is a cache hit on the replica that served the first."""
    import httpx
    from kvserve.service.sim.fleet import SimFleet
    from kvserve.service.sim.timing import timing_model
    from transformers import AutoTokenizer

    fleet = SimFleet(2, timing_model("h100-llama3-8b").scaled(1.0, num_blocks=64),
                     tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), model="tiny")
    await fleet.start()
    chat = {"model": "tiny", "max_tokens": 3, "messages": [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "What is the capital of France?"}]}
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            base = fleet.url(1)
            assert (await c.get(base + "/health")).json() == {"status": "ok"}
            assert (await c.get(base + "/v1/models")).json()["data"][0]["id"] == "tiny"
            first = (await c.post(base + "/v1/chat/completions", json=chat)).json()
            assert first["choices"][0]["message"]["content"] == " x x x"
            async with c.stream("POST", base + "/v1/chat/completions",
                                json=dict(chat, stream=True,
                                          stream_options={"include_usage": True})) as resp:
                assert resp.headers["content-type"] == "text/event-stream"
                events = [line async for line in resp.aiter_lines() if line.startswith("data:")]
            assert events[-1] == "data: [DONE]"
            usage = json.loads(events[-2][5:])["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # the system prompt
            assert usage["completion_tokens"] == 3
            done = json.loads(events[-3][5:])["choices"][0]
            assert done["finish_reason"] == "length"
            comp = await c.post(fleet.url(0) + "/v1/completions",
                                json={"prompt": [5, 6, 7], "max_tokens": 2})
            assert comp.json()["choices"][0]["text"] == " x x"
            bad = await c.post(fleet.url(0) + "/v1/completions", json={"prompt": [1],
                                                                       "max_tokens": 0})
            assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
            assert (await c.post(fleet.url(0) + "/v1/completions", content=b"[1]")).status_code \
                == 400
            assert (await c.get(f"http://127.0.0.1:{fleet.port}/r9/health")).status_code == 404
    finally:
        await fleet.close()
    assert fleet.replicas[1].counters.requests == 2 and fleet.replicas[0].counters.requests == 1
