"""The router over 3 real `kvserve serve` replicas (tiny model, CPU) and a real Redis: one router as
its own process (`python -m kvserve.service.router`), a second one inside the test process. Prefix
routing, overload skipping, two routers agreeing, Redis outage, a replica that stops heartbeating,
and a replica killed mid-run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from conftest import RedisServer, free_port
from forked_process import fork_module, stop_forkserver

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.service.prefix_index.lookup import PrefixIndex
from kvserve.service.router.prompt_tokens import prompt_tokens_for

SERVICE = "itest"
TENANT_PROMPTS = [
    f"You are the assistant of tenant {t}. Paged attention stores the KV cache in fixed-size "
    f"blocks, like virtual memory pages. Answer briefly and precisely; tenant {t} rules apply."
    for t in "ABCDEF"]


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen
    log: Path
    url: str

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Cluster:
    redis: RedisServer
    replicas: dict[str, Proc]
    routers: list[Proc]
    tokenizer: object
    procs: list[Proc] = field(default_factory=list)


# `python -m` modules and the module whose `main(argv)` a forked child runs for them.
FORK_MAINS = {"kvserve.service.cli": "kvserve.service.cli",
              "kvserve.service.router": "kvserve.service.router.cli"}


def spawn(name: str, args: list[str], port: int, tmp: Path,
          env: dict[str, str] | None = None, fork: bool = False) -> Proc:
    """`python -m *args`; with `fork`, forked from the preloaded fork server instead
    (tests/forked_process.py: a real process of its own, started in about a second; the
    caller ends the fork server with `stop_forkserver` once its children are gone)."""
    log = tmp / f"{name}.log"
    if fork:
        proc = fork_module(FORK_MAINS[args[0]], args[1:], log,
                           {"PYTHONUNBUFFERED": "1", **(env or {})})
        return Proc(name, proc, log, f"http://127.0.0.1:{port}")  # type: ignore[arg-type]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env)
    return Proc(name, proc, log, f"http://127.0.0.1:{port}")


def spawn_replica(rid: str, model: Path, redis_url: str, tmp: Path,
                  env: dict[str, str] | None = None, fork: bool = False) -> Proc:
    port = free_port()
    return spawn(rid, ["kvserve.service.cli", "serve", str(model), "--served-model-name", "tiny",
                       "--device", "cpu", "--enable-prompt-tokens-details",
                       "--kv-cache-memory", "8MiB", "--host", "127.0.0.1", "--port", str(port),
                       "--redis-url", redis_url, "--service-name", SERVICE, "--replica-id", rid,
                       "--advertise-url", f"http://127.0.0.1:{port}", "--log-level", "warning",
                       "--engine-core", "thread"],
                 port, tmp, env, fork)


# The tests read the chosen replica from the routing headers, off by default.
ROUTER_FLAGS = ["--service-name", SERVICE, "--overload-factor", "1.5", "--overload-slack", "2",
                "--log-level", "warning"]
HEADERS_FLAG = "--expose-routing-headers"


def spawn_router(name: str, model: Path, redis_url: str, tmp: Path, fork: bool = False) -> Proc:
    port = free_port()
    return spawn(name, ["kvserve.service.router", "--host", "127.0.0.1", "--port", str(port),
                        "--redis-url", redis_url, "--tokenizer", str(model), *ROUTER_FLAGS,
                        HEADERS_FLAG],
                 port, tmp, fork=fork)


class RouterThread:
    """A second router inside the test process (one torch import less on 2 busy cores)."""

    def __init__(self, model: Path, redis_url: str | None, extra: tuple[str, ...] = (),
                 expose_headers: bool = True) -> None:
        import argparse

        import uvicorn

        from kvserve.service.router.app import create_app
        from kvserve.service.router.cli import add_arguments, config_from_args

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        self.port = free_port()
        redis = ["--redis-url", redis_url] if redis_url else []
        cfg = config_from_args(parser.parse_args(
            ["--port", str(self.port), *redis, "--tokenizer", str(model), *ROUTER_FLAGS,
             *([HEADERS_FLAG] if expose_headers else []), *extra]))
        self.server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self) -> None:
        wait_until(lambda: self.server.started, timeout=120, what="the in-process router")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_healthy(p: Proc, deadline: float) -> None:
    while time.monotonic() < deadline:
        if p.proc is not None and p.proc.poll() is not None:
            raise AssertionError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}")
        try:
            if httpx.get(p.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{p.name} not healthy in time:\n{p.log_tail()}")


@pytest.fixture(scope="module")
def cluster(redis_binary, tiny_model_dir, tmp_path_factory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("router-cluster")
    redis = RedisServer(redis_binary, tmp)
    redis.start()
    replicas = {rid: spawn_replica(rid, tiny_model_dir, redis.url, tmp, fork=True)
                for rid in ("r1", "r2", "r3")}
    routers = [spawn_router("router1", tiny_model_dir, redis.url, tmp, fork=True)]
    in_process = RouterThread(tiny_model_dir, redis.url)
    routers.append(Proc("router2", None, tmp / "router1.log",  # type: ignore[arg-type]
                        f"http://127.0.0.1:{in_process.port}"))
    c = Cluster(redis, replicas, routers, load_tokenizer(tiny_model_dir),
                [*replicas.values(), routers[0]])
    try:
        deadline = time.monotonic() + 240
        for p in [*c.procs, routers[1]]:
            wait_healthy(p, deadline)
        for router in routers:  # the router sees all three replicas
            wait_until(lambda r=router: len(httpx.get(r.url + "/health").json()["replicas"]) == 3,
                       what=f"{router.name} seeing 3 replicas")
        yield c
    finally:
        in_process.stop()
        for p in c.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.kill()
            p.proc.wait()
        stop_forkserver()
        redis.stop()


def wait_until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def chat_body(system: str, user: str, max_tokens: int = 4, **kw) -> dict:
    return {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, **kw,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def chat(url: str, body: dict) -> httpx.Response:
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def chain(c: Cluster, body: dict) -> list[str]:
    return block_hashes(prompt_tokens_for(c.tokenizer, "/v1/chat/completions", body), 16)


def index_matches(c: Cluster, hashes: list[str]) -> dict[str, int]:
    async def go() -> dict[str, int]:
        index = PrefixIndex.from_url(c.redis.url, SERVICE)
        try:
            return {m.replica.replica_id: m.matched_blocks for m in await index.lookup(hashes)}
        finally:
            await index.close()

    return asyncio.run(go())


def router_metric(router: Proc, name: str) -> float:
    total = 0.0
    for line in httpx.get(router.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def seed(c: Cluster, system: str) -> str:
    """Send one request with `system` through router 1; wait until Redis shows who holds it."""
    body = chat_body(system, "seed")
    holder = chat(c.routers[0].url, body).headers["x-kvserve-replica"]
    hashes = chain(c, body)
    wait_until(lambda: index_matches(c, hashes).get(holder) == len(hashes),
               what=f"{holder} publishing the seeded prefix")
    return holder


def test_router_hash_chain_equals_what_the_replica_stored(cluster):
    body = chat_body(TENANT_PROMPTS[0], "What is the capital of France?")
    resp = chat(cluster.routers[0].url, body)
    holder = resp.headers["x-kvserve-replica"]
    hashes = chain(cluster, body)
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    assert len(hashes) == prompt_tokens // 16 >= 3
    wait_until(lambda: index_matches(cluster, hashes).get(holder) == len(hashes),
               what="the replica's stored hashes to equal the router's chain")
    # The same prompt again: the router predicts the full chain and the replica reports a hit.
    again = chat(cluster.routers[0].url, body)
    assert again.headers["x-kvserve-replica"] == holder
    assert int(again.headers["x-kvserve-predicted-matched-tokens"]) == len(hashes) * 16
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(hashes) * 16 - 16


def test_shared_system_prompt_lands_on_its_holder_for_both_routers(cluster):
    holders = {i: seed(cluster, TENANT_PROMPTS[i]) for i in (1, 2, 3)}
    for i, holder in holders.items():
        for k, router in enumerate(cluster.routers):
            resp = chat(router.url, chat_body(TENANT_PROMPTS[i], f"user {k} asks {i}"))
            assert resp.headers["x-kvserve-replica"] == holder, f"tenant {i} via {router.name}"
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    assert router_metric(cluster.routers[1], "kvserve_router:predicted_matched_tokens_sum") > 0


def test_two_routers_choose_the_same_replica(cluster):
    for system in TENANT_PROMPTS[4:6]:
        holder = seed(cluster, system)
        choices = {chat(r.url, chat_body(system, "same question")).headers["x-kvserve-replica"]
                   for r in cluster.routers}
        assert choices == {holder}


def test_an_overloaded_holder_is_skipped(cluster):
    system = TENANT_PROMPTS[0] + " Overload test."
    holder = seed(cluster, system)
    replica = cluster.replicas[holder]
    load_body = {"model": "tiny", "prompt": "load", "max_tokens": 480, "ignore_eos": True}
    stop = threading.Event()

    async def keep_busy() -> list[int]:
        # Ten clients each send one request after another until told to stop: the holder stays
        # loaded however fast this machine decodes (one round of ten can end between heartbeats).
        async def worker() -> list[int]:
            codes = []
            while not stop.is_set():
                codes.append((await client.post(replica.url + "/v1/completions",
                                                json=load_body)).status_code)
            return codes

        async with httpx.AsyncClient(timeout=300) as client:
            return [c for codes in await asyncio.gather(*(worker() for _ in range(10)))
                    for c in codes]

    result: list = []
    t = threading.Thread(target=lambda: result.append(asyncio.run(keep_busy())))
    t.start()
    try:
        wait_until(lambda: _load_of(cluster, holder) >= 6, what=f"{holder} reporting its load")
        resp = chat(cluster.routers[0].url, chat_body(system, "while busy"))
        elsewhere = resp.headers["x-kvserve-replica"]
        assert elsewhere != holder
    finally:
        stop.set()
        t.join()
    assert result[0] and all(code == 200 for code in result[0])
    # Once the load is gone, the prefix wins again (both now hold it).
    wait_until(lambda: _load_of(cluster, holder) == 0, what=f"{holder} idle again")
    assert chat(cluster.routers[0].url, chat_body(system, "idle")).headers[
        "x-kvserve-replica"] in {holder, elsewhere}


def _load_of(c: Cluster, rid: str) -> int:
    health = httpx.get(c.routers[0].url + "/health").json()
    return next((r["load"] for r in health["replicas"] if r["id"] == rid), -1)


def test_streaming_through_the_router_with_the_openai_client(cluster):
    client = openai.Client(base_url=cluster.routers[1].url + "/v1", api_key="dummy")
    question = [{"role": "user", "content": "Explain the KV cache"}]
    stream = client.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                            stream=True, messages=question)
    chunks = [c.choices[0].delta.content for c in stream
              if c.choices and c.choices[0].delta.content]
    direct = client.with_options(base_url=cluster.replicas["r1"].url + "/v1")
    same = direct.chat.completions.create(model="tiny", max_tokens=12, temperature=0,
                                          messages=question)
    assert "".join(chunks) == same.choices[0].message.content and len(chunks) > 1
    models = client.models.list()
    assert len(models.data) == 1


def test_completions_prompts_as_text_and_token_ids_are_routed_by_prefix(cluster):
    router = cluster.routers[1]
    text = TENANT_PROMPTS[3] + " Completions."
    ids = prompt_tokens_for(cluster.tokenizer, "/v1/completions", {"prompt": text})
    first = httpx.post(router.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": text, "max_tokens": 2})
    holder = first.headers["x-kvserve-replica"]
    hashes = block_hashes(ids, 16)
    wait_until(lambda: index_matches(cluster, hashes).get(holder) == len(hashes),
               what="the completion prompt's blocks")
    for prompt in (text, ids, [ids]):  # text, token ids, and a batch of one
        resp = httpx.post(router.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-kvserve-replica"] == holder
        assert int(resp.headers["x-kvserve-predicted-matched-tokens"]) == len(hashes) * 16


def test_static_replicas_without_redis(cluster, tiny_model_dir):
    urls = [cluster.replicas[r].url for r in ("r1", "r2")]
    router = RouterThread(tiny_model_dir, None, ("--replicas", ",".join(urls)))
    try:
        router.wait()
        served = [chat(router.url, chat_body(TENANT_PROMPTS[0], f"static {i}")).headers[
            "x-kvserve-replica"] for i in range(4)]
        assert set(served) == set(urls)  # least load over the static set (ids are the URLs)
        proc = Proc("static", None, Path(), router.url)  # type: ignore[arg-type]
        assert router_metric(proc, "kvserve_router:redis_up") == 0
        assert router_metric(proc, "kvserve_router:replicas_up") == 2
    finally:
        router.stop()


def test_session_policy_keeps_a_session_on_one_replica(cluster, tiny_model_dir):
    router = RouterThread(tiny_model_dir, cluster.redis.url, ("--policy", "session"))
    try:
        router.wait()
        chosen = {}
        for user in [f"user-{i}" for i in range(8)]:
            got = {httpx.post(router.url + "/v1/chat/completions", timeout=60,
                              headers={"x-session-id": user},
                              json=chat_body(TENANT_PROMPTS[k], user)).headers["x-kvserve-replica"]
                   for k in range(3)}
            assert len(got) == 1, f"{user} moved between {got}"
            chosen[user] = got.pop()
        assert len(set(chosen.values())) >= 2
    finally:
        router.stop()


def test_redis_outage_degrades_to_least_load_and_recovers(cluster):
    router = cluster.routers[0]
    system = TENANT_PROMPTS[1] + " Redis outage."
    # The loads frozen at the outage must be equal, or least-load rightly picks one replica.
    wait_until(lambda: all(r["load"] == 0 and r["inflight"] == 0 for r in
                           httpx.get(router.url + "/health").json()["replicas"]),
               what="every replica idle")
    cluster.redis.stop()
    try:
        wait_until(lambda: router_metric(router, "kvserve_router:redis_up") == 0,
                   what="redis_up 0")
        before = router_metric(router, "kvserve_router:requests_total")
        served = {chat(router.url, chat_body(system, f"q{i}")).headers["x-kvserve-replica"]
                  for i in range(4)}
        assert router_metric(router, "kvserve_router:requests_total") == before + 4
        assert len(served) >= 2  # least load spreads sequential requests over the known replicas
        assert router_metric(router, "kvserve_router:redis_errors_total") > 0
    finally:
        cluster.redis.start()
    wait_until(lambda: router_metric(router, "kvserve_router:redis_up") == 1, what="redis_up 1")
    wait_until(lambda: len(httpx.get(router.url + "/health").json()["replicas"]) == 3,
               what="replicas re-registering")
    # The replicas republish their full sets (their events were dropped during the outage) ...
    after = chat_body(system, "after the outage")
    shared = _common_prefix(chain(cluster, chat_body(system, "q0")), chain(cluster, after))
    assert len(shared) >= 3
    wait_until(lambda: all(index_matches(cluster, shared).get(r) == len(shared) for r in served),
               what="replicas republishing what they cached during the outage")
    # ... and prefix routing works again.
    resp = chat(router.url, after)
    assert resp.headers["x-kvserve-replica"] in served
    assert int(resp.headers["x-kvserve-predicted-matched-tokens"]) == len(shared) * 16
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(shared) * 16


def _common_prefix(a: list[str], b: list[str]) -> list[str]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_a_replica_that_stops_heartbeating_leaves_routing(cluster):
    frozen = cluster.replicas["r3"]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        for router in cluster.routers:
            wait_until(lambda r=router: "r3" not in {x["id"] for x in httpx.get(
                r.url + "/health").json()["replicas"]}, what="r3 leaving routing")
        for i in range(6):  # a request sent to the frozen replica would hang: none is
            resp = httpx.post(cluster.routers[i % 2].url + "/v1/chat/completions",
                              json=chat_body(TENANT_PROMPTS[i], "frozen?"), timeout=30)
            assert resp.status_code == 200 and resp.headers["x-kvserve-replica"] != "r3"
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: len(httpx.get(cluster.routers[0].url + "/health").json()["replicas"]) == 3,
               what="r3 back after SIGCONT")


def test_killing_a_replica_loses_no_request_that_had_not_started_streaming(cluster):
    router = cluster.routers[0]
    # Earlier tests may leave a replica busy for a moment; the prefix must win on its own here.
    wait_until(lambda: all(r["load"] == 0 and r["inflight"] == 0 for r in
                           httpx.get(router.url + "/health").json()["replicas"]),
               what="every replica idle")
    system = TENANT_PROMPTS[2] + " Victim."
    victim = seed(cluster, system)  # the prefix pins the stream and the burst to the victim
    # 128 prompt tokens + 360 within the tiny model's 512: a stream that is still running
    body = chat_body(system, "long answer", max_tokens=360, ignore_eos=True, stream=True)
    retries = router_metric(router, "kvserve_router:retries_total")
    migrations = router_metric(router, "kvserve:router_migrations_total")

    async def run() -> tuple[bytes, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as client:
            async with client.stream("POST", router.url + "/v1/chat/completions",
                                     json=body) as stream:
                assert stream.status_code == 200
                assert stream.headers["x-kvserve-replica"] == victim
                chunks = stream.aiter_raw()
                received = await anext(chunks)
                posts = [asyncio.create_task(client.post(
                    router.url + "/v1/chat/completions",
                    json=chat_body(system, f"burst {i}", max_tokens=64))) for i in range(12)]
                while _inflight(router, victim) < 3:  # the stream + at least 2 unanswered posts
                    await asyncio.sleep(0.02)
                cluster.replicas[victim].proc.kill()
                async for chunk in chunks:
                    received += chunk
            return received, await asyncio.gather(*posts)

    received, answers = asyncio.run(asyncio.wait_for(run(), 180))
    # the stream was mid-way: the router moved it to another replica (service/router/
    # migration.py), so it ends whole, with one [DONE] and no error event
    assert b'"error"' not in received and received.count(b"[DONE]") == 1
    assert b'"finish_reason":"length"' in received
    assert router_metric(router, "kvserve:router_migrations_total") >= migrations + 1
    assert [r.status_code for r in answers] == [200] * 12
    # the 2+ posts in flight on the victim were moved too: retried whole when their replica had
    # not answered yet, continued (a migration) when it had begun (the router asks a whole
    # answer of the replica as a stream: service/router/whole_answer.py)
    moved = (router_metric(router, "kvserve_router:retries_total") - retries
             + router_metric(router, "kvserve:router_migrations_total") - migrations)
    assert moved >= 3
    assert {r.headers["x-kvserve-replica"] for r in answers} - {victim}


def _inflight(router: Proc, rid: str) -> int:
    health = httpx.get(router.url + "/health").json()
    return next((r["inflight"] for r in health["replicas"] if r["id"] == rid), 0)
