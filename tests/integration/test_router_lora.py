"""LoRA-aware routing on real parts: a real redis-server, three simulated replicas (service/sim/:
vLLM's adapter endpoints, an LRU of resident adapters, heartbeats with the resident list) and a
real uvicorn router with `--lora-modules`. A request for an adapter goes to a replica holding it;
a registered adapter nobody holds is loaded once, on the least-loaded replica, even for many
concurrent requests; a replica that evicted it since its heartbeat has it loaded again (never a
404); an unregistered unknown name reaches a replica, which answers 404."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import RedisServer, build_tiny_tokenizer
from test_router import SERVICE, RouterThread, wait_until

from kvserve.service.sim.fleet import SimFleet
from kvserve.service.sim.replica import SimReplica
from kvserve.service.sim.timing import TimingModel

ADAPTERS = {"sql": "/weights/adapters/sql", "chat": "/weights/adapters/chat",
            "poem": "/weights/adapters/poem", "code": "/weights/adapters/code"}
MODEL = "tiny"


@dataclass
class Fleet:
    sim: SimFleet
    loop: asyncio.AbstractEventLoop
    redis: RedisServer
    tokenizer: Path

    @property
    def replicas(self) -> list[SimReplica]:
        return self.sim.replicas

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def fleet(redis_binary, tmp_path_factory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("router-lora")
    tok = tmp / "tok"
    build_tiny_tokenizer().save_pretrained(tok)
    (tok / "config.json").write_text('{"model_type": "llama"}')
    redis = RedisServer(redis_binary, tmp)
    redis.start()
    timing = TimingModel("lora", prefill_s_per_token=0.0, decode_step_s=0.01,
                         decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0, num_blocks=512)
    sim = SimFleet(3, timing, redis_url=redis.url, service=SERVICE, model=MODEL,
                   heartbeat_interval=0.2, max_loras=2, lora_load_s=0.3)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    f = Fleet(sim, loop, redis, tok)
    f.run(sim.start(), 60)
    try:
        yield f
    finally:
        f.run(sim.close(), 60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        redis.stop()


@pytest.fixture
def router(fleet) -> Iterator[RouterThread]:
    fleet.run(_idle_and_reset(fleet.sim))
    modules = [f"{n}={p}" for n, p in ADAPTERS.items()]
    rt = RouterThread(fleet.tokenizer, fleet.redis.url,
                      ("--lora-modules", *modules, "--lora-load-timeout", "30"))
    rt.wait()
    # the reset replicas' heartbeats (no adapter resident) have reached the router's table
    wait_until(lambda: held(rt.url) == [[], [], []], timeout=30,
               what="the router to see the three replicas, holding no adapter")
    try:
        yield rt
    finally:
        rt.stop()


async def _idle_and_reset(sim: SimFleet) -> None:
    while not sim.idle():
        await asyncio.sleep(0.05)
    sim.reset()


def held(router_url: str) -> list[list[str]]:
    """The adapters each replica holds, in replica id order, as the router's table has them
    (what it routes by)."""
    replicas = httpx.get(router_url + "/health", timeout=10).json()["replicas"]
    return [r["adapters"] for r in sorted(replicas, key=lambda r: r["id"])]


def body(model: str, salt: int = 0, max_tokens: int = 2) -> dict:
    return {"model": model, "prompt": [100 + salt + i for i in range(40)],
            "max_tokens": max_tokens}


def served_by(fleet: Fleet, adapter: str) -> dict[int, int]:
    """{replica index: requests it ran with `adapter`} from the replicas' own counters."""
    return {i: r.counters.adapter_requests for i, r in enumerate(fleet.replicas)
            if r.counters.adapter_requests}


def loads(fleet: Fleet) -> list[int]:
    return [r.counters.adapter_loads for r in fleet.replicas]


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and \
                all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_missing_registered_adapter_is_loaded_on_the_least_loaded_replica(fleet, router):
    # Replicas 0 and 2 are busy with long base-model requests; replica 1 is idle.
    busy = concurrent.futures.ThreadPoolExecutor(4)
    long = [busy.submit(httpx.post, fleet.sim.url(i) + "/v1/completions",
                        json=body(MODEL, salt=i, max_tokens=300), timeout=60)
            for i in (0, 0, 2, 2)]
    wait_until(lambda: sorted(r["load"] for r in httpx.get(router.url + "/health").json()
                              ["replicas"]) == [0, 2, 2], timeout=20, what="heartbeat loads")
    resp = httpx.post(router.url + "/v1/completions", json=body("sql"), timeout=30)
    assert resp.status_code == 200, resp.text
    assert loads(fleet) == [0, 1, 0] and "sql" in fleet.replicas[1].adapters
    # The next request finds it resident there: no second load, even with replica 1 busier.
    resp = httpx.post(router.url + "/v1/completions", json=body("sql", salt=7), timeout=30)
    assert resp.status_code == 200 and loads(fleet) == [0, 1, 0]
    assert served_by(fleet, "sql") == {1: 2}
    assert metric(router.url, "kvserve_router:adapter_loads_total", adapter="sql",
                  result="ok") == 1
    assert metric(router.url, "kvserve_router:adapter_requests_total", adapter="sql",
                  outcome="loaded") == 1
    assert metric(router.url, "kvserve_router:adapter_requests_total", adapter="sql",
                  outcome="resident") == 1
    for f in long:
        assert f.result().status_code == 200
    busy.shutdown()


def test_concurrent_requests_for_a_missing_adapter_trigger_one_load(fleet, router):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda k: httpx.post(router.url + "/v1/completions",
                                                     json=body("chat", salt=k), timeout=30),
                                range(8)))
    assert [a.status_code for a in answers] == [200] * 8
    assert sum(loads(fleet)) == 1  # the sim's load takes 0.3 s: all 8 arrived during it
    (holder,) = [i for i, r in enumerate(fleet.replicas) if "chat" in r.adapters]
    assert served_by(fleet, "chat") == {holder: 8}


def test_a_holder_is_preferred_over_a_prefix_match_and_lower_load(fleet, router):
    # The prompt is cached (base model) on replica 0; the adapter is resident on replica 2 only.
    assert httpx.post(fleet.sim.url(0) + "/v1/completions", json=body(MODEL, salt=50),
                      timeout=30).status_code == 200
    assert httpx.post(fleet.sim.url(2) + "/v1/load_lora_adapter", timeout=30, json={
        "lora_name": "poem", "lora_path": ADAPTERS["poem"]}).status_code == 200
    wait_until(lambda: held(router.url) == [[], [], ["poem"]], timeout=10,
               what="the router's table to have replica 2 holding the adapter")
    for k in range(3):
        resp = httpx.post(router.url + "/v1/completions", json=body("poem", salt=50 + k),
                          timeout=30)
        assert resp.status_code == 200, resp.text
    assert served_by(fleet, "poem") == {2: 3} and loads(fleet) == [0, 0, 1]
    assert held(router.url) == [[], [], ["poem"]]


def test_an_adapter_evicted_since_the_heartbeat_is_loaded_again_not_404(fleet, router):
    assert httpx.post(router.url + "/v1/completions", json=body("code"),
                      timeout=30).status_code == 200
    (holder,) = [i for i, r in enumerate(fleet.replicas) if "code" in r.adapters]
    # The replica drops it (an eviction); the router still believes it holds it.
    assert httpx.post(fleet.sim.url(holder) + "/v1/unload_lora_adapter",
                      json={"lora_name": "code"}, timeout=10).status_code == 200
    resp = httpx.post(router.url + "/v1/completions", json=body("code", salt=3), timeout=30)
    assert resp.status_code == 200, resp.text
    assert loads(fleet)[holder] == 2 and served_by(fleet, "code") == {holder: 2}


def test_an_unregistered_unknown_name_gets_the_replicas_404(fleet, router):
    resp = httpx.post(router.url + "/v1/completions", json=body("nobody-has-this"), timeout=30)
    assert resp.status_code == 404
    assert "does not exist" in resp.json()["error"]["message"]
    assert sum(loads(fleet)) == 0
    assert metric(router.url, "kvserve_router:adapter_requests_total") == 0  # not an adapter


def test_models_lists_the_base_model_and_every_registered_adapter(fleet, router):
    data = httpx.get(router.url + "/v1/models", timeout=10).json()["data"]
    by_id = {m["id"]: m for m in data}
    assert set(by_id) == {MODEL, *ADAPTERS}
    assert all(by_id[n]["parent"] == MODEL and by_id[n]["root"] == p for n, p in ADAPTERS.items())
    assert sum(loads(fleet)) == 0  # listing loads nothing
