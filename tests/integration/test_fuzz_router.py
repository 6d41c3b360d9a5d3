"""Hostile JSON against the router (hypothesis): NaN/Infinity, huge ints, deep nesting, invalid
UTF-8, huge lists, random values in every field the router reads. The router, in front of a real
replica (tiny model, in this process) with a real Redis so it tokenizes to route, never answers
5xx, answers errors in OpenAI's shape, and still routes a normal request afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import RedisServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_api_server import start_server
from test_router import RouterThread

PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed",
          "n", "stop", "logprobs", "cache_salt", "stream", "user", "chat_template",
          "add_generation_prompt", "stop_token_ids", "prompt_token_ids")


@pytest.fixture(scope="module")
def router(redis_binary, tiny_model_dir,
           tmp_path_factory) -> Iterator[tuple[RouterThread, Any]]:
    redis = RedisServer(redis_binary, tmp_path_factory.mktemp("fuzz-redis"))
    redis.start()
    replica = start_server(tiny_model_dir)
    rt = RouterThread(tiny_model_dir, redis.url, ("--replicas", replica.url,
                                                  "--max-json-depth", "16"))
    try:
        rt.wait()
        yield rt, replica
    finally:
        rt.stop()
        replica.stop()
        redis.stop()


# JSON that Python's json module writes but strict parsers refuse (NaN, Infinity), ints far past
# 64 bits, long strings and lists.
hostile_scalar = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 2**64, -(2**63) - 1, 10**400,
                     1e308, -0.0, "", "\u0000", "\ud800", True, None]),
    st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=64))
hostile_json = st.recursive(
    hostile_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=6),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20)
huge_list = st.sampled_from([["x"] * 5000, list(range(50_000)), [[1, 2]] * 2000,
                             [{"role": "user", "content": "x"}] * 3000])


def _encode(value: Any) -> bytes:
    return json.dumps(value, allow_nan=True).encode("utf-8", errors="surrogatepass")


@st.composite
def hostile_body(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(PATHS))
    base: dict[str, Any] = {"model": "tiny", "max_tokens": 1}
    base["prompt" if path == "/v1/completions" else "messages"] = \
        "hi" if path == "/v1/completions" else [{"role": "user", "content": "hi"}]
    kind = draw(st.sampled_from(["field", "huge_list", "nesting", "utf8", "raw"]))
    if kind == "field":
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            base[name] = draw(hostile_json)
        return path, _encode(base)
    if kind == "huge_list":
        base[draw(st.sampled_from(("prompt", "messages", "stop", "stop_token_ids")))] = \
            draw(huge_list)
        return path, _encode(base)
    if kind == "nesting":
        depth = draw(st.integers(17, 100_000))
        return path, b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == "utf8":
        junk = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"]))
        return path, _encode(base).replace(b'"hi"', b'"h' + junk + b'i"')
    return path, draw(st.binary(max_size=64))  # not JSON at all


def assert_openai_shape(resp: httpx.Response) -> None:
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=hostile_body())
def test_hostile_bodies_never_get_5xx_from_the_router(router, case):
    rt, _ = router
    path, body = case
    resp = httpx.post(rt.url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"})
    assert resp.status_code < 500, (body[:200], resp.text[:500])
    if resp.status_code >= 400:
        assert_openai_shape(resp)


def test_the_router_still_routes_after_the_fuzz(router):
    rt, replica = router
    resp = httpx.post(rt.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "still?"}]})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvserve-replica"] == replica.url
    assert httpx.get(rt.url + "/health").status_code == 200
