"""Hostile and unsupported input against a real server (uvicorn + httpx/openai, tiny model): every
case is a 4xx in OpenAI's shape, and the server still answers a normal request afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_thread import ServerThread
from test_api_server import CHAT, assert_openai_error, post, start_server

from kvserve.service.limits import RequestLimits

LIMITS = RequestLimits(max_prompts=8, max_prompt_tokens=200, max_n=4, max_stop=4,
                       max_stop_len=32, max_logprobs=5, max_json_depth=16)


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    srv = start_server(tiny_model_dir, limits=LIMITS)
    yield srv
    srv.stop()


def still_serving(server: ServerThread) -> None:
    """/health is ok and a normal completion still runs after the hostile one."""
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    ok = post(server.url, "/v1/completions", {"model": "tiny", "prompt": "alive?",
                                              "max_tokens": 2, "seed": 7, "temperature": 1.0})
    assert ok.status_code == 200, ok.text


def raw_post(server: ServerThread, path: str, text: str) -> httpx.Response:
    return post(server.url, path, text.encode())


# ---------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("seed", [str(2**64 + 5), str(2**63), str(-(2**63) - 1), "1" + "0" * 30,
                                  "9" * 5000])  # the last is past Python's int-parsing limit
def test_a_seed_outside_64_bits_is_400_and_the_engine_lives(server, seed):
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1, "seed": %s}' % seed
    assert_openai_error(raw_post(server, "/v1/completions", body), 400,
                        None if len(seed) > 4300 else "seed")
    still_serving(server)


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 0])
def test_seeds_at_the_ends_of_the_range_are_served(server, seed):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 1, "seed": seed,
            "n": 2}
    resp = post(server.url, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert post(server.url, "/v1/completions", body).json()["choices"] == resp.json()["choices"]


FLOATS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty"]


@pytest.mark.parametrize("field", FLOATS)
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_nan_and_infinity_are_400_naming_the_field(server, field, value):
    body = '{"model": "tiny", "prompt": "x", "max_tokens": 2, "%s": %s}' % (field, value)
    assert_openai_error(raw_post(server, "/v1/completions", body), 400, field)
    chat = '{"model": "tiny", "messages": %s, "max_tokens": 2, "%s": %s}' % (
        json.dumps(CHAT), field, value)
    assert_openai_error(raw_post(server, "/v1/chat/completions", chat), 400, field)


@pytest.mark.parametrize("body, param", [
    ({"temperature": 1000}, "temperature"),
    ({"repetition_penalty": 1e6}, "repetition_penalty"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"top_k": 10**30}, "top_k"),
    ({"priority": 10**30}, "priority"),
    ({"min_tokens": 10**30}, "min_tokens"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids.0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ({"prompt": [[1, 2, 10**30]]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
])
def test_out_of_range_integers_and_floats_are_400(server, body, param):
    resp = post(server.url, "/v1/completions", {"model": "tiny", "prompt": "x", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param)
    still_serving(server)


@pytest.mark.parametrize("tokens", [[10**30], [-1], [2**40]])
def test_detokenize_refuses_ids_it_cannot_decode(server, tokens):
    assert_openai_error(post(server.url, "/detokenize", {"tokens": tokens}), 400, None)
    still_serving(server)


# ---------------------------------------------------------------------------- shapes and sizes


def test_deeply_nested_json_is_400(server):
    deep = '{"model": "tiny", "prompt": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert_openai_error(raw_post(server, "/v1/completions", deep), 400)
    over = '{"model": "tiny", "prompt": "x", "extra": ' + "[" * 20 + "]" * 20 + "}"
    resp = raw_post(server, "/v1/completions", over)
    assert_openai_error(resp, 400)
    assert "nest" in resp.json()["error"]["message"]
    fits = '{"model": "tiny", "prompt": "x", "max_tokens": 1, "extra": ' + "[" * 10 + \
        "]" * 10 + "}"
    assert raw_post(server, "/v1/completions", fits).status_code == 200
    still_serving(server)


def test_invalid_utf8_and_lone_surrogates_are_400(server):
    assert_openai_error(post(server.url, "/v1/completions",
                             b'{"model": "tiny", "prompt": "\xff\xfe"}'), 400)
    lone = '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 1}'
    assert_openai_error(raw_post(server, "/v1/completions", lone), 400)
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'
    assert_openai_error(raw_post(server, "/v1/chat/completions", chat), 400)
    still_serving(server)


def test_too_many_prompts_is_400_at_once(server):
    resp = post(server.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 100_000})
    assert_openai_error(resp, 400, "prompt")
    assert "8" in resp.json()["error"]["message"]  # names the cap
    ids = post(server.url, "/v1/completions", {"model": "tiny", "prompt": [[5]] * 9})
    assert_openai_error(ids, 400, "prompt")
    ok = post(server.url, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 8,
                                              "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8
    still_serving(server)


def test_total_prompt_tokens_over_the_cap_is_400(server):
    ids = [[5] * 80] * 3  # 240 tokens in all, each prompt fits the context
    assert_openai_error(post(server.url, "/v1/completions", {"model": "tiny", "prompt": ids}),
                        400, "prompt")
    ok = post(server.url, "/v1/completions", {"model": "tiny", "prompt": ids[:2],
                                              "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, param", [
    ({"n": 5}, "n"),
    ({"n": 10**30}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": "x" * 33}, "stop"),
    ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),  # only echo makes 0 mean something (the prompt alone)
])
def test_caps_on_n_stop_and_logprobs(server, body, param):
    resp = post(server.url, "/v1/completions", {"model": "tiny", "prompt": "x", **body})
    assert_openai_error(resp, 400, param)


@pytest.mark.parametrize("field, at_cap, over_cap", [
    ("stop", ["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]),
    ("stop", "x" * 32, "x" * 33),
    ("stop", ["x" * 32], ["x" * 33]),
    ("stop_token_ids", [1, 2, 3, 4], [1, 2, 3, 4, 5]),
    ("n", 4, 5),
    ("logprobs", 5, 6),
    ("prompt_logprobs", 5, 6),
])
def test_each_cap_accepts_exactly_its_limit_and_refuses_one_more(server, field, at_cap, over_cap):
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    ok = post(server.url, "/v1/completions", {**body, field: at_cap})
    assert ok.status_code == 200, ok.text
    assert_openai_error(post(server.url, "/v1/completions", {**body, field: over_cap}), 400,
                        field)


def test_chat_top_logprobs_cap(server):
    body = {"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 6}
    assert_openai_error(post(server.url, "/v1/chat/completions", body), 400, "top_logprobs")


# ---------------------------------------------------------------------------- unsupported fields


UNSUPPORTED = [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", {"name": "f"}),
    ("/v1/chat/completions", "early_stopping", True),
    ("/v1/chat/completions", "truncate_prompt_tokens", 4),
    ("/v1/chat/completions", "continue_final_message", True),
    ("/v1/completions", "early_stopping", True),
    ("/v1/completions", "logits_processors", ["x"]),
    ("/v1/completions", "allowed_token_ids", [1, 2]),
    ("/v1/completions", "bad_words", ["x"]),
    ("/v1/completions", "suffix", "tail"),
]


def _base(path: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": CHAT, "max_tokens": 1}
    return {"model": "tiny", "prompt": "x", "max_tokens": 1}


@pytest.mark.parametrize("path, field, value", UNSUPPORTED)
def test_known_but_unsupported_fields_are_refused_by_name(server, path, field, value):
    resp = post(server.url, path, {**_base(path), field: value})
    assert_openai_error(resp, 400, field)
    assert field in resp.json()["error"]["message"]


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"best_of": 1}),
    ("/v1/completions", {"best_of": 2, "n": 2}),
    ("/v1/completions", {"use_beam_search": False, "logit_bias": {}}),
    ("/v1/chat/completions", {"tools": [], "tool_choice": "none"}),
    ("/v1/chat/completions", {"tool_choice": "auto", "parallel_tool_calls": True}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}),
    ("/v1/chat/completions", {"some_vendor_extra": {"a": 1}, "metadata": {"k": "v"}}),
])
def test_values_that_ask_for_nothing_and_unknown_fields_are_accepted(server, path, extra):
    resp = post(server.url, path, {**_base(path), **extra})
    assert resp.status_code == 200, resp.text


def test_a_malformed_tool_call_in_the_history_is_refused(server):
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"arguments": "{}"}}]}]
    resp = post(server.url, "/v1/chat/completions", {"model": "tiny", "messages": messages})
    assert_openai_error(resp, 400, "messages.1.tool_calls")


@pytest.mark.parametrize("path, field, value, param", [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": ""}}], "tools.0"),
    ("/v1/chat/completions", "tool_choice", "required", "tool_choice"),  # with no tools
    ("/v1/chat/completions", "response_format", {"type": "xml"}, "response_format"),
    ("/v1/chat/completions", "guided_json", {"type": "nonsense"}, "guided_json"),
    ("/v1/chat/completions", "guided_regex", "a(b", "guided_regex"),
    ("/v1/completions", "response_format", {"type": "json_schema", "json_schema": {}},
     "response_format"),
    ("/v1/completions", "guided_grammar", "root ::= undefined_rule", "guided_grammar"),
    ("/v1/completions", "guided_choice", [], "guided_choice"),
    ("/v1/completions", "logit_bias", {"x": 1}, "logit_bias"),
    ("/v1/completions", "best_of", 0, "best_of"),
    ("/v1/completions", "best_of", 17, "best_of"),
    ("/v1/completions", "logit_bias", {"5": 101}, "logit_bias"),
    ("/v1/completions", "logit_bias", {"99999": 1}, "logit_bias"),  # past the vocabulary
])
def test_bad_structured_output_and_tool_fields_are_400s(server, path, field, value, param):
    resp = post(server.url, path, {**_base(path), field: value})
    assert_openai_error(resp, 400, param)


def test_the_openai_client_gets_a_bad_request_error_for_tools(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, tools=[
            {"type": "function", "function": {"name": "f", "parameters": "not a schema"}}])
    assert info.value.body["param"] == "tools.0"


# ---------------------------------------------------------------------------- configuration


def test_caps_come_from_the_config(tiny_model_dir):
    srv = start_server(tiny_model_dir, limits=RequestLimits(max_prompts=2))
    try:
        assert_openai_error(post(srv.url, "/v1/completions",
                                 {"model": "tiny", "prompt": ["a", "b", "c"]}), 400, "prompt")
        ok = post(srv.url, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"],
                                               "max_tokens": 1, "n": 5})
        assert ok.status_code == 200, ok.text  # n's default cap is 16
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- the router


@pytest.fixture(scope="module")
def router(redis_binary, server, tiny_model_dir, tmp_path_factory) -> Iterator[Any]:
    """A router (real uvicorn, in this process) with Redis up, so it tokenizes to route, in front
    of the module's server as its static replica."""
    from conftest import RedisServer
    from test_router import RouterThread

    redis = RedisServer(redis_binary, tmp_path_factory.mktemp("redis"))
    redis.start()
    rt = RouterThread(tiny_model_dir, redis.url, (
        "--replicas", server.url, "--max-prompts-per-request", "8", "--max-json-depth", "16"))
    try:
        rt.wait()
        yield rt
    finally:
        rt.stop()
        redis.stop()


def router_still_routes(router: Any) -> None:
    resp = post(router.url, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert "x-kvserve-replica" in resp.headers


def test_a_40_mib_body_to_the_router_is_413_at_once(router):
    body = b'{"model": "tiny", "prompt": "' + b"x" * (40 << 20) + b'"}'
    resp = httpx.post(router.url + "/v1/completions", content=body, timeout=60,
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)

    def chunked() -> Iterator[bytes]:  # no content-length: counted while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(4 << 10):
            yield b"y" * 1024
        yield b'"}'

    resp = httpx.post(router.url + "/v1/chat/completions", content=chunked(), timeout=60,
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)
    router_still_routes(router)


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"model": "tiny", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", None),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "e": ' + "[" * 20 + "]" * 20 + "}",
     None),
    ("/v1/completions", '{"model": "tiny", "prompt": [' + ", ".join(['"a"'] * 9) + "]}",
     "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": [[1, 99999999999]]}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "seed": 1e400}', "seed"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "seed": %d}' % 2**64, "seed"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x"}], '
     '"tools": [{"type": "function", "function": {"name": ""}}]}', "tools"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": "not a list"}', "messages"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": '
     '"\\ud800"}]}', None),
    ("/v1/chat/completions", '{"model": ', None),
])
def test_the_router_refuses_hostile_bodies_itself(router, path, text, param):
    resp = post(router.url, path, text.encode())
    assert_openai_error(resp, 400)
    if param is not None:  # a union's member tag may follow, e.g. "prompt.list[list[int]].0.1"
        assert resp.json()["error"]["param"].startswith(param)
    assert "x-kvserve-replica" not in resp.headers  # answered by the router, not a replica
    router_still_routes(router)


# ---------------------------------------------------------------------------- SIGTERM drain


def test_sigterm_cuts_off_requests_with_503_and_an_sse_error(tiny_model_dir, tmp_path):
    """A real server process drained with no grace period while two requests are seen running
    (its /metrics): the non-streaming one gets 503 + Retry-After, the streaming one an error
    event, then [DONE]. (Grace 0: the cut does not race the requests' length against a timer.)"""
    import signal
    import threading

    from conftest import wait_for
    from server_process import api_server_process
    from test_api_server import metrics

    log = tmp_path / "server.log"
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True}
    whole: list[httpx.Response] = []
    with api_server_process(tiny_model_dir, log, "--max-model-len", "512",
                            "--shutdown-grace-period", "0") as (proc, url):
        thread = threading.Thread(target=lambda: whole.append(
            httpx.post(url + "/v1/completions", json=body, timeout=120)))
        thread.start()
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url + "/v1/completions",
                             json={**body, "stream": True}) as resp:
                lines = resp.iter_lines()
                next(lines)
                wait_for(lambda: metrics(url)["vllm:num_requests_running"] == 2, 60, "2 running")
                proc.send_signal(signal.SIGTERM)
                events = [line[6:] for line in lines if line.startswith("data: ")]
        thread.join(120)
        assert proc.wait(60) == 0
    from kvserve.service.server.handback import handback_body

    # Judged on what the signal left, not on timing: the stream was cut short of its max_tokens
    # (one chunk per token before the error), and the server counted both requests as aborted.
    # Both are handed back for the router to migrate: the stream's last event (no [DONE]) and
    # the other's 503 carry kvserve_migrate (service/server/handback.py).
    assert 1 <= len(events) - 1 < body["max_tokens"], len(events)
    assert json.loads(events[-1]) == handback_body()
    (cut,) = whole
    assert cut.status_code == 503 and cut.json() == handback_body()
    assert cut.headers["retry-after"] == "1" and cut.headers["x-kvserve-migrate"] == "1"
    assert "drained (2 request(s) aborted)" in log.read_text()


def test_tokenize_refuses_a_tool_call_without_a_function(server):
    """Found by the OpenAPI fuzzer: /tokenize rendered `tool_calls: [{}]` and crashed (500)."""
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]}
    assert_openai_error(post(server.url, "/tokenize", body), 400, "messages.0.tool_calls")
