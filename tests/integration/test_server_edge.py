"""The replica's edge under load and abuse (real uvicorn, real openai client, tiny model): the event
loop stays free while big prompts are tokenized and prefilled, request chat templates need trust,
a default waiting bound, per-request deadlines, drain deregistration from Redis, cache_salt."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from conftest import build_tiny_llama, wait_for
from server_thread import ServerThread
from test_api_server import CHAT, assert_openai_error, blocks_all_free, post, start_server

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.limits import RequestLimits
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.publishing import make_publisher

LONG = {"max_tokens": 240, "temperature": 0, "ignore_eos": True}  # ~240 engine steps


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir)
    yield srv
    srv.stop()


# ---------------------------------------------------------------------------- the event loop


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-8k",
                            max_position_embeddings=8192)


def test_health_answers_while_near_cap_prompts_are_in_flight(long_context_model):
    """Two ~6k-token prompts the engine runs (prefill, then a long decode) and three ~100k-token
    prompts being tokenized (within --max-prompt-tokens-per-request, past the context: the server
    tokenizes each whole before it can say so): /health answers while both are in flight.

    The in-flight state is held, not timed: the tokenizer pool's jobs for the huge prompts are
    gated (after their real tokenizing) until the test has its answers, and the engine reports
    the big prompts running before and after each answer. A server that tokenized on the event
    loop never reaches the gate (the wait for it fails); one whose loop waited on the pool or on
    the engine would leave /health unanswered (the client's hang guard fails the test)."""
    engine = LLMEngine.from_config(EngineConfig(
        model=str(long_context_model), max_model_len=8192, kv_cache_memory=32 << 20,
        dtype="float32"))
    config = ServerConfig(served_model_names=["tiny"], max_body_bytes=1 << 20,
                          limits=RequestLimits(max_prompt_tokens=120_000))
    app = create_app(engine, config)
    pool = app.state.ctx.tokenizers
    real_call, gate, held = pool._call, threading.Event(), threading.Semaphore(0)

    def gated_call(fn, args):  # the pool's worker: real tokenizing, then the test's gate
        out = real_call(fn, args)
        texts = [t for a in args for t in (a if isinstance(a, list) else [a])]
        if any(isinstance(t, str) and len(t) > 100_000 for t in texts):
            held.release()
            gate.wait(300)
        return out

    pool._call = gated_call
    srv = ServerThread(app).start()
    sentence = "Paged attention stores the KV cache in fixed-size blocks. "
    huge = {"model": "tiny", "prompt": sentence * 4000, "max_tokens": 4}  # ~108k tokens
    big = {"model": "tiny", "prompt": sentence * 220, "max_tokens": 1500,  # ~6k tokens
           "ignore_eos": True}

    def running() -> int:
        return engine.get_stats().num_running

    async def send_all() -> list[int]:
        async with httpx.AsyncClient(timeout=600) as http:
            async def one(body: dict) -> int:
                return (await http.post(srv.url + "/v1/completions", json=body)).status_code

            bigs = [asyncio.create_task(one(big)) for _ in range(2)]
            await asyncio.to_thread(wait_for, lambda: running() == 2, 120,
                                    "the engine running both big prompts")
            huges = [asyncio.create_task(one(huge)) for _ in range(3)]
            for _ in range(2):  # both pool threads hold a huge prompt's tokens
                assert await asyncio.to_thread(held.acquire, True, 120), "no huge prompt tokenized"
            try:
                for _ in range(3):
                    assert running() == 2
                    # a hang guard, not a speed claim: a blocked loop never answers
                    resp = await http.get(srv.url + "/health", timeout=60)
                    assert resp.status_code == 200
                    assert running() == 2 and not any(t.done() for t in bigs + huges)
            finally:
                gate.set()
            return list(await asyncio.gather(*huges, *bigs))

    try:
        statuses = asyncio.run(send_all())
    finally:
        gate.set()
        srv.stop()
    assert statuses == [400, 400, 400, 200, 200]


# ---------------------------------------------------------------------------- chat templates

PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
RUNAWAY_TEMPLATE = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                    "{% endfor %}")


def test_a_request_chat_template_is_refused_without_trust(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                       extra_body={"chat_template": PLAIN_TEMPLATE})
    assert err.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in err.value.body["message"]
    resp = post(server.url, "/v1/chat/completions", {
        "model": "tiny", "messages": CHAT, "max_tokens": 2,
        "chat_template_kwargs": {"chat_template": PLAIN_TEMPLATE}})
    assert_openai_error(resp, 400, "chat_template_kwargs")


@pytest.fixture(scope="module")
def trusting_server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir, trust_request_chat_template=True,
                       chat_template_time_limit=0.5)
    yield srv
    srv.stop()


def test_a_trusted_request_template_renders_with_its_kwargs(trusting_server):
    client = openai.Client(base_url=trusting_server.url + "/v1", api_key="x", max_retries=0)
    template = "{{ greeting }}" + PLAIN_TEMPLATE
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hello. "}})
    text = "Hello. " + CHAT[0]["content"]
    ids = httpx.post(trusting_server.url + "/tokenize",
                     json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("template, words", [
    (RUNAWAY_TEMPLATE, "time limit"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),  # jinja's sandbox refuses dunder access
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
])
def test_a_trusted_template_is_sandboxed_and_time_limited(trusting_server, template, words):
    started = time.monotonic()
    resp = post(trusting_server.url, "/v1/chat/completions", {
        "model": "tiny", "messages": CHAT, "max_tokens": 2, "chat_template": template},
        timeout=60)
    assert_openai_error(resp, 400, "chat_template")
    assert words in resp.json()["error"]["message"]
    print(f"refused after {time.monotonic() - started:.2f} s")
    ok = post(trusting_server.url, "/v1/chat/completions",
              {"model": "tiny", "messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200


# ---------------------------------------------------------------------------- backpressure


def test_max_waiting_defaults_to_a_bound_from_max_num_seqs():
    assert ServerConfig().waiting_limit(max_num_seqs=8) == 32
    assert ServerConfig(max_waiting=None).waiting_limit(8) is None
    assert ServerConfig(max_waiting=3).waiting_limit(8) == 3


async def test_the_default_waiting_bound_answers_429(tiny_model_dir):
    # One running slot, so the default bound is 4 waiting: of 12 requests sent at once, some get
    # 429 + Retry-After instead of a place in the queue.
    srv = start_server(tiny_model_dir, engine_kw={"max_num_seqs": 1})
    body = {"model": "tiny", "prompt": "The quick", **LONG, "max_tokens": 30}
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            resps = await asyncio.gather(*(http.post(srv.url + "/v1/completions", json=body)
                                           for _ in range(12)))
        codes = [r.status_code for r in resps]
        assert set(codes) == {200, 429} and codes.count(200) >= 4, codes
        for r in resps:
            if r.status_code == 429:
                assert_openai_error(r, 429)
                assert r.headers["retry-after"] == "1"
        wait_for(lambda: blocks_all_free(srv.url), what="blocks free")
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- deadlines


@pytest.fixture(scope="module")
def deadline_server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir, request_timeout=60.0)
    yield srv
    srv.stop()


def quarter_of(url: str, path: str, body: dict) -> str:
    """The `x-request-timeout` text of a deadline a quarter of the time `body` takes without
    one, on this machine (a fixed 0.3 s outlasted the whole request on a fast CPU)."""
    started = time.monotonic()
    resp = post(url, path, body, timeout=120)
    assert resp.status_code == 200, resp.text
    return f"{max((time.monotonic() - started) / 4, 0.02):.3f}"


def test_a_request_past_its_deadline_is_504_and_aborted(deadline_server):
    url = deadline_server.url
    body = {"model": "tiny", "prompt": "The quick", "n": 8, **LONG}
    deadline = quarter_of(url, "/v1/completions", body)
    started = time.monotonic()
    resp = post(url, "/v1/completions", body, headers={"x-request-timeout": deadline},
                timeout=60)
    assert_openai_error(resp, 504)
    assert resp.json()["error"]["code"] == "request_timeout"
    print(f"504 after {time.monotonic() - started:.2f} s")
    wait_for(lambda: blocks_all_free(url), what="the aborted request's blocks back")
    ok = post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_stream_past_its_deadline_ends_with_an_error_event(deadline_server):
    client = openai.Client(base_url=deadline_server.url + "/v1", api_key="x", max_retries=0)
    chat = {"model": "tiny", "messages": CHAT, "max_tokens": 150, "temperature": 0, "n": 8}
    deadline = quarter_of(deadline_server.url, "/v1/chat/completions",
                          {**chat, "ignore_eos": True})
    stream = client.chat.completions.create(
        **chat, stream=True, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Timeout": deadline})
    got = []
    with pytest.raises(openai.APIError) as err:
        for chunk in stream:
            got.append(chunk)
    assert got and "deadline" in str(err.value.message)
    body = {"model": "tiny", "prompt": "x", "n": 8, **LONG}
    deadline = quarter_of(deadline_server.url, "/v1/completions", body)
    with httpx.stream("POST", deadline_server.url + "/v1/completions",
                      json={**body, "stream": True}, headers={"x-request-timeout": deadline},
                      timeout=60) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "timeout_error"
    wait_for(lambda: blocks_all_free(deadline_server.url), what="blocks back")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_timeout_header_is_400(deadline_server, value):
    resp = post(deadline_server.url, "/v1/completions", {"model": "tiny", "prompt": "x"},
                headers={"x-request-timeout": value})
    assert_openai_error(resp, 400)


# ---------------------------------------------------------------------------- drain


def test_drain_takes_the_replica_out_of_redis_before_requests_finish(tiny_model_dir,
                                                                      redis_server):
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=256,
                                                kv_cache_memory=4 << 20, dtype="float32"))
    config = ServerConfig(served_model_names=["tiny"], redis_url=redis_server.url,
                          service_name="svc", replica_id="r1", advertise_url="http://r1:8000",
                          shutdown_grace_period=60)
    publisher = make_publisher(config, "tiny", engine.block_size)
    srv = ServerThread(create_app(engine, config, publisher)).start()
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        wait_for(lambda: r.sismember("kvserve:{svc}:replicas", "r1"), what="the heartbeat")
        body = {"model": "tiny", "prompt": "The quick", "stream": True, **LONG}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            srv.drain()  # what SIGTERM does
            wait_for(lambda: not r.sismember("kvserve:{svc}:replicas", "r1")
                     and not r.exists("kvserve:{svc}:replica:r1"), what="deregistration")
            assert srv.server.engine.num_active == 1  # the stream still runs
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        srv.thread.join(30)  # the drain ends the server once the stream is done
        assert not srv.thread.is_alive()
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- tenants


def test_cache_salt_separates_prefix_cache_entries(tiny_model_dir):
    srv = start_server(tiny_model_dir, enable_prompt_tokens_details=True)
    client = openai.Client(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "Shared system prompt of one tenant. " * 6},
                {"role": "user", "content": "Hi"}]

    def cached(salt: str | None) -> int:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           extra_body={"cache_salt": salt} if salt else None)
        return r.usage.prompt_tokens_details.cached_tokens

    try:
        cached("tenant-a")
        assert cached("tenant-a") >= 32  # the same tenant hits its own blocks
        assert cached("tenant-b") == 0  # another tenant does not see them
        assert cached(None) == 0
        done = client.completions.create(model="tiny", prompt="abc " * 20, max_tokens=2,
                                         extra_body={"cache_salt": "t"})
        assert done.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        srv.stop()


@pytest.mark.parametrize("salt", ["", "x" * 1025, 42, ["a"]])
def test_a_bad_cache_salt_is_400(server, salt):
    for path, body in [("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})]:
        resp = post(server.url, path, {"model": "tiny", "max_tokens": 2, "cache_salt": salt,
                                       **body})
        assert_openai_error(resp, 400, "cache_salt")


def test_cached_token_counts_are_not_reported_by_default(client, server):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    again = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert r.usage.prompt_tokens_details is None and again.usage.prompt_tokens_details is None
    resp = post(server.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert not [h for h in resp.headers if h.lower().startswith("x-kvserve")]
    assert resp.json()["usage"].get("prompt_tokens_details") is None
