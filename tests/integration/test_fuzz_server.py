"""Fuzzing a real server: schemathesis against its own OpenAPI document (every operation, valid and
schema-violating inputs) and hypothesis strategies for hostile JSON (NaN and infinities, huge
integers, deep nesting, invalid UTF-8, huge lists). No answer may be a 5xx, every error is in
OpenAI's shape, and afterwards the server still answers and every KV block is free again.

Bounded to run in well under a minute: a short context (64 tokens) and `n` at most 2 keep any
request that passes validation cheap, and each fuzz draws a fixed number of examples."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from conftest import wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from server_thread import ServerThread

from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.service.limits import RequestLimits
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
              "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/inference/v1/generate",
              "/v1/chat/completions/batch"]
FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    engine = LLMEngine.from_config(EngineConfig(model=str(tiny_model_dir), max_model_len=64,
                                                kv_cache_memory=4 << 20, dtype="float32",
                                                enable_lora=True))
    config = ServerConfig(served_model_names=["tiny"], max_body_bytes=256 << 10,
                          limits=RequestLimits(max_n=2, max_prompts=4, max_json_depth=16),
                          request_timeout=20.0)
    with pytest.MonkeyPatch.context() as mp:  # the runtime LoRA routes exist with it set
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        app = create_app(engine, config)
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def check_answer(resp: httpx.Response, what: str) -> None:
    """No 5xx; an error has OpenAI's shape; a stream carries no server error event."""
    assert resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:500]}"
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, err)
        assert isinstance(err["message"], str) and err["message"]
        assert err["code"] is None or isinstance(err["code"], str)
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                status_type = json.loads(line[6:])["error"]["type"]
                assert status_type not in ("server_error", "upstream_error"), (what, line)


def still_serving(server: ServerThread, http: httpx.Client) -> None:
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "alive?", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    engine = server.server.engine
    wait_for(lambda: engine.num_active == 0 and engine.last_stats is not None
             and engine.last_stats.num_running == 0, what="no request left")
    free = _free_blocks(http)
    assert free[0] == free[1], f"KV blocks leaked: {free[1] - free[0]} of {free[1]} in use"


def _free_blocks(http: httpx.Client) -> tuple[float, float]:
    values = {}
    for line in http.get("/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in ("kvserve:free_blocks", "kvserve:total_blocks"):
            values[name] = float(line.rsplit(" ", 1)[1])
    return values["kvserve:free_blocks"], values["kvserve:total_blocks"]


# ---------------------------------------------------------------------------- schemathesis


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_of_the_openapi_document(server, http, mode):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(POST_PATHS) | {"/health", "/v1/models"}
    bodies = {op.path for op in operations if op.body}
    assert bodies == set(POST_PATHS)  # the document holds the real request bodies
    strategy = st.one_of(*(op.as_strategy(generation_mode=mode) for op in operations))

    @FUZZ
    @given(case=strategy)
    def fuzz(case) -> None:
        resp = case.call(base_url=server.url)
        check_answer(_as_httpx(resp), case.as_curl_command())

    fuzz()
    still_serving(server, http)


def _as_httpx(resp) -> httpx.Response:
    headers = [(k, v) for k, values in resp.headers.items() for v in values]
    return httpx.Response(resp.status_code, headers=headers, content=resp.content)


# ---------------------------------------------------------------------------- hostile JSON

JSON_FIELDS = ["prompt", "messages", "max_tokens", "n", "temperature", "top_p", "seed", "stop",
               "stop_token_ids", "logprobs", "top_logprobs", "tokens", "cache_salt",
               "chat_template_kwargs", "stream", "stream_options", "priority", "min_tokens"]
NON_FINITE = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"])
HUGE_INT = st.one_of(st.integers(min_value=2**63 - 2, max_value=2**80),
                     st.integers(min_value=-(2**80), max_value=-(2**63) + 2),
                     st.just("9" * 5000))
BAD_UTF8 = st.sampled_from([b'"\xff\xfe"', b'"\xc3"', b'"\xed\xa0\x80"', b'"\\ud800"',
                            b'"a\x00b"'])


@st.composite
def deep(draw) -> bytes:
    depth = draw(st.integers(min_value=15, max_value=50_000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    return opener * depth + b"1" + closer * depth


@st.composite
def huge_list(draw) -> bytes:
    size = draw(st.integers(min_value=1_000, max_value=60_000))
    item = draw(st.sampled_from([b"1", b"[1]", b'"x"', b'{"role":"user","content":"x"}']))
    return b"[" + b",".join([item] * size) + b"]"


def _json(value) -> bytes:
    return json.dumps(value).encode()


HOSTILE_VALUE = st.one_of(
    NON_FINITE.map(str.encode), HUGE_INT.map(lambda v: str(v).encode()), BAD_UTF8, deep(),
    huge_list(), st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False)
                              | st.integers() | st.text(max_size=20),
                              lambda c: st.lists(c, max_size=4)
                              | st.dictionaries(st.text(max_size=8), c, max_size=4),
                              max_leaves=12).map(_json))


@st.composite
def hostile_body(draw) -> bytes:
    """A body with a realistic base and hostile values spliced into some fields (as raw JSON
    text, so NaN and invalid UTF-8 reach the server as sent)."""
    base = draw(st.sampled_from([
        {"model": "tiny", "prompt": "hi", "max_tokens": 2},
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {"model": "tiny", "prompt": "hi"}, {"tokens": [1, 2]}]))
    fields = draw(st.lists(st.sampled_from(JSON_FIELDS), min_size=1, max_size=3, unique=True))
    parts = [_json(k) + b":" + _json(v) for k, v in base.items() if k not in fields]
    parts += [_json(k) + b":" + draw(HOSTILE_VALUE) for k in fields]
    if draw(st.booleans()):
        return draw(st.one_of(deep(), huge_list(), BAD_UTF8, NON_FINITE.map(str.encode)))
    return b"{" + b",".join(parts) + b"}"


def test_hostile_json_is_4xx_in_openai_shape(server, http):
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=200)
    @given(path=st.sampled_from(POST_PATHS), body=hostile_body())
    def fuzz(path: str, body: bytes) -> None:
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        check_answer(resp, f"{path} {body[:200]!r}")

    fuzz()
    print(f"statuses: {sorted(statuses.items())}")
    assert statuses.get(400, 0) > 100  # the strategies do reach the validation
    still_serving(server, http)
