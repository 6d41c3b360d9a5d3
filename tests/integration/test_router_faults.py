"""The router's faults and trust on real parts: two `kvserve serve` replicas (tiny model, CPU) that
sign their heartbeats, a real Redis, routers in this process and as processes. A frozen replica
(SIGSTOP) is timed out and failed over; a client that leaves aborts its request on the replica;
SIGTERM drains the router; --api-key; routing headers only when enabled; cache_salt routes by the
salted chain; signed registration; garbage in Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis
from conftest import RedisServer
from forked_process import stop_forkserver
from test_router import (SERVICE, Proc, RouterThread, chat_body, index_matches, spawn,
                         spawn_replica, wait_healthy, wait_until)

from kvserve.engine.core.block_hash import block_hashes
from kvserve.engine.sample.tokenizer import load_tokenizer
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.replica_info import REGISTRATION_TOKEN_ENV
from kvserve.service.router.prompt_tokens import prompt_tokens_for

TOKEN = "registration-token-of-the-test"
SYSTEM = ("You are the assistant of the faults test. Paged attention stores the KV cache in "
          "fixed-size blocks, like virtual memory pages. Answer briefly.")


@dataclass
class Pair:
    redis: RedisServer
    replicas: dict[str, Proc]
    tokenizer: object
    model: object


@pytest.fixture(scope="module")
def pair(redis_binary, tiny_model_dir, tmp_path_factory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("router-faults")
    server = RedisServer(redis_binary, tmp)
    server.start()
    env = {REGISTRATION_TOKEN_ENV: TOKEN}
    replicas = {rid: spawn_replica(rid, tiny_model_dir, server.url, tmp, env, fork=True)
                for rid in ("f1", "f2")}
    try:
        deadline = time.monotonic() + 240
        for p in replicas.values():
            wait_healthy(p, deadline)
        yield Pair(server, replicas, load_tokenizer(tiny_model_dir), tiny_model_dir)
    finally:
        for p in replicas.values():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
                p.proc.kill()
            p.proc.wait()
        stop_forkserver()
        server.stop()


@contextmanager
def router(pair: Pair, *flags: str, token: str | None = TOKEN, redis_on: bool = True
           ) -> Iterator[RouterThread]:
    """A router in this process (its registration token read from the env, as in production)."""
    old = os.environ.pop(REGISTRATION_TOKEN_ENV, None)
    if token is not None:
        os.environ[REGISTRATION_TOKEN_ENV] = token
    try:
        rt = RouterThread(pair.model, pair.redis.url if redis_on else None, flags,
                          expose_headers=False)
    finally:
        os.environ.pop(REGISTRATION_TOKEN_ENV, None)
        if old is not None:
            os.environ[REGISTRATION_TOKEN_ENV] = old
    try:
        rt.wait()
        yield rt
    finally:
        rt.stop()


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if not (line.startswith(name + " ") or line.startswith(name + "{")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def health_ids(url: str) -> set[str]:
    return {r["id"] for r in httpx.get(url + "/health", timeout=10).json()["replicas"]}


# ---------------------------------------------------------------------------- a hung replica


def test_a_frozen_replica_is_timed_out_and_failed_over(pair):
    """Static replicas (no heartbeat can expire): only the first-byte deadline finds the frozen
    one. Its requests go to the other replica; then it stays down for the cooldown."""
    frozen, alive = pair.replicas["f1"], pair.replicas["f2"]
    flags = ("--replicas", f"{frozen.url},{alive.url}", "--policy", "round-robin",
             "--upstream-first-byte-timeout", "1", "--down-cooldown", "60",
             "--expose-routing-headers")
    with router(pair, *flags, redis_on=False) as rt:
        frozen.proc.send_signal(signal.SIGSTOP)
        try:
            models = httpx.get(rt.url + "/v1/models", timeout=60)  # not held by the frozen one
            assert [m["id"] for m in models.json()["data"]] == ["tiny"]
            served = []
            for i in range(4):  # round robin puts the frozen replica first at least once
                resp = httpx.post(rt.url + "/v1/chat/completions", timeout=60,
                                  json=chat_body(SYSTEM, f"frozen {i}", stream=i % 2 == 1))
                assert resp.status_code == 200, resp.text
                served.append(resp.headers["x-kvserve-replica"])
            assert set(served) == {alive.url}
            assert metric(rt.url, "kvserve_router:upstream_errors_total",
                          replica=frozen.url, stage="before_first_byte") == 1
            assert health_ids(rt.url) == {alive.url}  # down for the cooldown: no second wait
        finally:
            frozen.proc.send_signal(signal.SIGCONT)
    wait_healthy(frozen, time.monotonic() + 30)


@contextmanager
def slow_replica(model_dir: Path, seconds_per_token: float) -> Iterator[str]:
    """A simulated replica (service/sim/) on its own event loop thread: /health answers at
    once, and an answer of n tokens takes at least n x `seconds_per_token` (its steps are
    sleeps), whatever the CPU's speed. Yields its URL."""
    from transformers import AutoTokenizer

    from kvserve.service.sim.fleet import SimFleet
    from kvserve.service.sim.timing import TimingModel

    timing = TimingModel("slow", prefill_s_per_token=0.0, decode_step_s=seconds_per_token,
                         decode_s_per_seq=0.0, decode_s_per_ctx_token=0.0, num_blocks=256)
    fleet = SimFleet(1, timing, tokenizer=AutoTokenizer.from_pretrained(model_dir), model="tiny")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(60)
    try:
        yield fleet.url(0)
    finally:
        asyncio.run_coroutine_threadsafe(fleet.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_busy_replica_that_answers_health_is_not_timed_out(tiny_model_dir):
    """A non-streamed answer that takes far longer than the first-byte timeout (100 tokens of
    at least 20 ms each against 0.2 s): /health still answers, so the router waits for it
    rather than failing over (which would run it twice)."""
    with slow_replica(tiny_model_dir, 0.02) as url:
        rt = RouterThread(tiny_model_dir, None, ("--replicas", url, "--policy", "least-load",
                                                 "--upstream-first-byte-timeout", "0.2"),
                          expose_headers=False)
        try:
            rt.wait()
            resp = httpx.post(rt.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": "busy", "max_tokens": 100})
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 100
            assert metric(rt.url, "kvserve_router:upstream_errors_total") == 0
        finally:
            rt.stop()


# ---------------------------------------------------------------------------- client disconnects


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_the_router_aborts_its_request_on_the_replica(pair, stream):
    replica = pair.replicas["f2"]
    with router(pair, "--replicas", replica.url, "--policy", "least-load",
                redis_on=False) as rt:
        aborted = metric(replica.url, "vllm:request_success_total", finished_reason="abort")
        body = {"model": "tiny", "prompt": "leave early", "max_tokens": 480, "ignore_eos": True,
                "stream": stream}

        async def leave() -> None:
            async with httpx.AsyncClient(timeout=60) as client:
                if stream:
                    async with client.stream("POST", rt.url + "/v1/completions",
                                             json=body) as resp:
                        await anext(resp.aiter_raw())
                        assert metric(replica.url, "vllm:num_requests_running") == 1
                    return  # leaving the block closes the connection mid-stream
                task = asyncio.create_task(client.post(rt.url + "/v1/completions", json=body))
                while metric(replica.url, "vllm:num_requests_running") < 1:
                    await asyncio.sleep(0.05)
                task.cancel()  # closes the connection before any byte came back
                await asyncio.gather(task, return_exceptions=True)

        asyncio.run(leave())
        wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 0,
                   what="the replica to stop running the request")
        assert metric(replica.url, "vllm:request_success_total",
                      finished_reason="abort") == aborted + 1
        wait_until(lambda: metric(rt.url, "kvserve_router:client_disconnects_total") == 1,
                   what="the router counting the disconnect")


# ---------------------------------------------------------------------------- drain


def test_sigterm_drains_the_router(pair, tmp_path):
    """A router process: after SIGTERM a new request gets 503 + Retry-After and /health 503,
    while the stream in flight runs to [DONE]; then the process exits by itself."""
    from conftest import free_port

    replica = pair.replicas["f2"]
    port = free_port()
    proc = spawn("drain-router", ["kvserve.service.router", "--host", "127.0.0.1", "--port",
                                  str(port), "--replicas", replica.url, "--policy", "least-load",
                                  "--shutdown-grace-period", "60", "--log-level", "info"],
                 port, tmp_path, fork=True)
    try:
        wait_healthy(proc, time.monotonic() + 120)
        body = {"model": "tiny", "prompt": "drain", "max_tokens": 200, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as resp:
            chunks = resp.iter_raw()
            received = next(chunks)
            proc.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: httpx.get(proc.url + "/health").status_code == 503,
                       what="/health saying draining")
            refused = httpx.post(proc.url + "/v1/completions", timeout=10,
                                 json={"model": "tiny", "prompt": "late", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert proc.proc.poll() is None  # still serving the stream
            for chunk in chunks:
                received += chunk
        assert received.rstrip().endswith(b"data: [DONE]")
        assert proc.proc.wait(timeout=30) == 0
        assert "draining 1 request(s) in flight" in proc.log_tail()
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_the_router_cuts_streams_still_running_when_the_grace_period_ends(pair, tmp_path):
    """A stream that outlives the grace period ends with an SSE error event the openai client
    raises on (never a clean short answer), and the replica aborts its request."""
    from conftest import free_port

    replica = pair.replicas["f2"]
    port = free_port()
    proc = spawn("short-grace", ["kvserve.service.router", "--host", "127.0.0.1", "--port",
                                 str(port), "--replicas", replica.url, "--policy", "least-load",
                                 "--shutdown-grace-period", "0.5"], port, tmp_path, fork=True)
    try:
        wait_healthy(proc, time.monotonic() + 120)
        client = openai.Client(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="cut", max_tokens=480,
                                           stream=True, extra_body={"ignore_eos": True})
        texts = []
        with pytest.raises(openai.APIError, match="shut down before the stream finished"):
            for chunk in stream:
                if not texts:  # the replica stalls, so the stream outlives the grace
                    replica.proc.send_signal(signal.SIGSTOP)
                    proc.proc.send_signal(signal.SIGTERM)
                texts.append(chunk.choices[0].text)
        assert 0 < len(texts) < 480
        assert proc.proc.wait(timeout=30) == 0
    finally:
        replica.proc.send_signal(signal.SIGCONT)
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
    wait_until(lambda: metric(replica.url, "vllm:num_requests_running") == 0,
               what="the replica aborting the cut stream")


# ---------------------------------------------------------------------------- tenants and trust


def test_the_router_api_key(pair):
    with router(pair, "--api-key", "router-key") as rt:
        missing = httpx.post(rt.url + "/v1/chat/completions", json=chat_body(SYSTEM, "hi"))
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.get(rt.url + "/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(rt.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(rt.url + "/metrics").status_code == 200
        client = openai.Client(base_url=rt.url + "/v1", api_key="router-key", max_retries=0)
        answer = client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "with the key"}])
        assert answer.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="other").models.list()


def test_routing_headers_only_when_enabled(pair):
    body = chat_body(SYSTEM, "headers")
    with router(pair) as rt:
        resp = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200
        assert not [h for h in resp.headers if h.lower().startswith("x-kvserve-")]
    with router(pair, "--expose-routing-headers") as rt:
        resp = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=60)
        assert resp.headers["x-kvserve-replica"] in pair.replicas
        assert "x-kvserve-predicted-matched-tokens" in resp.headers
        assert resp.headers["x-kvserve-predicted-host-tokens"] == "0"  # no host tier here


def test_a_salted_request_routes_by_its_salted_chain(pair):
    salt = "tenant-42"
    body = chat_body("Salted tenant. " + SYSTEM, "what is cached?", cache_salt=salt)
    tokens = prompt_tokens_for(pair.tokenizer, "/v1/chat/completions", body)
    salted, plain = block_hashes(tokens, 16, salt), block_hashes(tokens, 16)
    assert len(salted) >= 3 and not set(salted) & set(plain)
    with router(pair, "--expose-routing-headers") as rt:
        first = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=60)
        holder = first.headers["x-kvserve-replica"]
        c = _cluster_view(pair)
        # What the replica stored is the router's salted chain, and not the unsalted one.
        wait_until(lambda: index_matches(c, salted).get(holder) == len(salted),
                   what="the replica publishing the salted blocks")
        assert index_matches(c, plain).get(holder) == 0
        again = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=60)
        assert again.headers["x-kvserve-replica"] == holder
        assert int(again.headers["x-kvserve-predicted-matched-tokens"]) == len(salted) * 16
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            (len(salted) - 1) * 16
        unsalted = {**body}
        del unsalted["cache_salt"]
        other = httpx.post(rt.url + "/v1/chat/completions", json=unsalted, timeout=60)
        assert int(other.headers["x-kvserve-predicted-matched-tokens"]) == 0


def _cluster_view(pair: Pair):
    """What test_router.index_matches reads from a cluster: its Redis."""
    from types import SimpleNamespace

    return SimpleNamespace(redis=pair.redis)


def test_only_replicas_with_the_registration_token_are_routed(pair):
    with router(pair) as rt:  # the replicas' token: both routed
        wait_until(lambda: health_ids(rt.url) == {"f1", "f2"}, what="both signed replicas")
    with router(pair, token="another-token") as rt:
        resp = httpx.get(rt.url + "/health")
        assert resp.status_code == 503 and resp.json()["replicas"] == []
        assert metric(rt.url, "kvserve_router:replicas_ignored") == 2
        refused = httpx.post(rt.url + "/v1/chat/completions", json=chat_body(SYSTEM, "x"))
        assert refused.status_code == 503


def test_garbage_in_redis_never_stops_the_router(pair):
    r = redis.Redis.from_url(pair.redis.url)
    keys = IndexKeys(SERVICE)
    junk = {"junk-int": {"url": "http://127.0.0.1:1", "model": "tiny", "block_size": "x"},
            "junk-url": {"url": "ftp://nowhere", "heartbeat_at": "inf"}}
    for rid, fields in junk.items():
        r.hset(keys.replica(rid), mapping=fields)
        r.sadd(keys.replicas, rid)
    r.set(keys.replica("junk-type"), "a string")
    r.sadd(keys.replicas, "junk-type", b"\xff\xfe\x00")
    r.set(keys.blocks("f1"), "not a set")  # f1's real set replaced by a string
    try:
        with router(pair, token=None) as rt:
            for i in range(3):
                resp = httpx.post(rt.url + "/v1/chat/completions", timeout=60,
                                  json=chat_body(SYSTEM, f"garbage {i}"))
                assert resp.status_code == 200, resp.text
            assert health_ids(rt.url) == {"f1", "f2"}
            assert metric(rt.url, "kvserve_router:redis_up") == 1
            # Three bad heartbeats left out; the id without any heartbeat key is swept as dead.
            assert metric(rt.url, "kvserve_router:replicas_ignored") == 3
            assert not r.sismember(keys.replicas, b"\xff\xfe\x00")
    finally:
        r.delete(keys.replica("junk-type"), keys.blocks("f1"),
                 *(keys.replica(rid) for rid in junk))
        r.srem(keys.replicas, "junk-type", b"\xff\xfe\x00", *junk)
