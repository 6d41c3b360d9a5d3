"""Router migration's state machine against scripted upstreams: small real HTTP servers that
stream token by token (token k of choice i is the text "c{i}w{k} ") and break where the test's
script says (connection reset, EOF, an engine error event, a drain hand-back). The real router
app relays; the client must see one unbroken stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from conftest import free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from kvserve.service.router.migration_state import SpliceState, split_events

PROMPT_TOKENS = 5


@dataclass
class Script:
    """Shared by every fake replica: the n-th request any of them gets breaks as `breaks[n]`
    says ((after this many tokens, how) or None), and its body is kept."""

    breaks: list[tuple[int, str] | None] = field(default_factory=list)
    bodies: list[tuple[str, dict]] = field(default_factory=list)

    def take(self, name: str, body: dict) -> tuple[int, str] | None:
        self.bodies.append((name, body))
        n = len(self.bodies) - 1
        return self.breaks[n] if n < len(self.breaks) else None


def _chunk(obj: str, name: str, choices: list[dict], usage: dict | None = None) -> str:
    data = {"id": f"id-{name}", "object": obj, "created": 1000 + len(name), "model": "fake",
            "choices": choices, "usage": usage}
    return f"data: {json.dumps(data)}\n\n"


def _choice(chat: bool, i: int, k: int, finish: str | None) -> dict:
    text = f"c{i}w{k} "
    body = {"delta": {"content": text}} if chat else {"text": text, "logprobs": None}
    return {"index": i, **body, "finish_reason": finish, "token_ids": [100 * i + k]}


def fake_replica(name: str, script: Script) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def generate(body: dict, chat: bool):
        brk = script.take(name, body)
        obj = "chat.completion.chunk" if chat else "text_completion"
        cont = body.get("continuation")
        indices = [cont["index"]] if cont else list(range(body.get("n") or 1))
        start = len(cont["token_ids"]) if cont else 0
        if chat:
            yield _chunk(obj, name, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None} for i in indices])
        for k in range(start, body["max_tokens"]):
            if brk is not None and k - start == brk[0]:
                if brk[1] == "reset":
                    raise RuntimeError("the replica died")  # uvicorn drops the connection
                if brk[1] == "error_event":
                    yield ('data: {"error": {"message": "engine core died", "type": '
                           '"server_error", "param": null, "code": null}}\n\ndata: [DONE]\n\n')
                elif brk[1] == "timeout_event":
                    yield ('data: {"error": {"message": "past its deadline", "type": '
                           '"timeout_error", "param": null, "code": null}}\n\n')
                elif brk[1] == "drain":
                    yield ('data: {"error": {"message": "draining", "type": "service_unavailable",'
                           ' "param": null, "code": 503, "kvserve_migrate": true}}\n\n')
                return  # "eof": the stream just ends
            finish = "length" if k == body["max_tokens"] - 1 else None
            yield _chunk(obj, name, [_choice(chat, i, k, finish) for i in indices])
            await asyncio.sleep(0)
        if (body.get("stream_options") or {}).get("include_usage"):
            done = body["max_tokens"] * len(indices)
            yield _chunk(obj, name, [], {"prompt_tokens": PROMPT_TOKENS,
                                         "completion_tokens": done,
                                         "total_tokens": PROMPT_TOKENS + done})
        yield "data: [DONE]\n\n"

    async def whole(body: dict):
        """A non-streamed answer; a "reset" break dies after the status line went out."""
        brk = script.take(name, body)
        if brk is not None and brk[1] == "reset":
            raise RuntimeError("the replica died")
        text = "".join(f"c0w{k} " for k in range(body["max_tokens"]))
        yield json.dumps({"id": f"id-{name}", "object": "text_completion", "model": "fake",
                          "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream"):
            if script.breaks[len(script.bodies):][:1] == [(0, "drain")]:
                script.take(name, body)
                return JSONResponse({"error": {"message": "draining"}}, status_code=503,
                                    headers={"x-kvserve-migrate": "1"})
            return StreamingResponse(whole(body), media_type="application/json")
        return StreamingResponse(generate(body, False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        return StreamingResponse(generate(body, True), media_type="text/event-stream")

    return app


class Served:
    """An ASGI app served by uvicorn on a thread, on a free port."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@contextmanager
def fleet(script: Script, *flags: str, replicas: int = 2) -> Iterator[str]:
    """Fake replicas and a router app over them (static, least-load); yields the router URL."""
    import argparse

    from kvserve.service.router.app import create_app
    from kvserve.service.router.cli import add_arguments, config_from_args

    fakes = [Served(fake_replica(f"r{i}", script)) for i in range(replicas)]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = config_from_args(parser.parse_args(
        ["--replicas", ",".join(f.url for f in fakes), "--policy", "least-load",
         "--log-level", "warning", *flags]))
    router = Served(create_app(cfg))
    try:
        yield router.url
    finally:
        for s in [router, *fakes]:
            s.stop()


def stream(url: str, path: str, body: dict) -> list[dict | str]:
    """The SSE payloads the client gets (JSON objects, or "[DONE]")."""
    with httpx.stream("POST", url + path, json={"model": "fake", "stream": True, **body},
                      timeout=30) as resp:
        assert resp.status_code == 200
        raw = resp.read()
    payloads, rest = split_events(raw)
    assert rest == b""
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def texts(events: list, chat: bool = False) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        for c in e["choices"] if isinstance(e, dict) and "choices" in e else []:
            piece = (c["delta"].get("content") or "") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + piece
    return out


def expected(n: int, max_tokens: int) -> dict[int, str]:
    return {i: "".join(f"c{i}w{k} " for k in range(max_tokens)) for i in range(n)}


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("how", ["reset", "eof", "error_event", "drain"])
def test_a_broken_completion_stream_is_continued_on_another_replica(how):
    script = Script(breaks=[(3, how)])
    with fleet(script) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 8,
                                                 "stream_options": {"include_usage": True}})
        assert texts(events) == expected(1, 8)
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        first = script.bodies[0][0]
        assert {(e["id"], e["created"], e["model"]) for e in chunks} == \
            {(f"id-{first}", 1000 + len(first), "fake")}
        assert [c["finish_reason"] for e in chunks for c in e["choices"]][-1] == "length"
        assert all("token_ids" not in c for e in chunks for c in e["choices"])
        assert chunks[-1]["usage"] == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 8,
                                       "total_tokens": PROMPT_TOKENS + 8}
        (name0, body0), (name1, body1) = script.bodies
        assert name1 != name0  # the broken replica is not asked to continue
        assert body0["return_token_ids"] is True and "continuation" not in body0
        assert body1["continuation"] == {"token_ids": [0, 1, 2], "index": 0}
        assert body1["max_tokens"] == 8  # the original: the replica counts the delivered ones
        assert metric(url, "kvserve:router_migrations_total", reason=how,
                      outcome="migrated") == 1


def test_a_stream_that_does_not_break_is_relayed_unchanged_but_for_token_ids():
    script = Script()
    with fleet(script) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 4})
        assert texts(events) == expected(1, 4)
        assert all(e["usage"] is None for e in events if isinstance(e, dict))  # not asked for
        assert events[-1] == "[DONE]" and len(events) == 5
        asked = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 4,
                                                "return_token_ids": True})
        ids = [i for e in asked if isinstance(e, dict) for c in e["choices"]
               for i in c["token_ids"]]
        assert ids == [0, 1, 2, 3]
        assert metric(url, "kvserve:router_migrations_total") == 0


def test_a_chat_stream_says_its_role_once_and_keeps_every_token():
    script = Script(breaks=[(2, "reset")])
    with fleet(script) as url:
        events = stream(url, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "return_token_ids": True})
        roles = [c for e in events if isinstance(e, dict) for c in e["choices"]
                 if c["delta"].get("role")]
        assert len(roles) == 1
        assert texts(events, chat=True) == expected(1, 6)
        ids = [i for e in events if isinstance(e, dict) for c in e["choices"]
               for i in c.get("token_ids", [])]
        assert ids == list(range(6))


def test_each_unfinished_choice_of_n_2_is_continued_with_its_own_index():
    script = Script(breaks=[(3, "reset")])
    with fleet(script) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 7, "n": 2,
                                                 "stream_options": {"include_usage": True}})
        assert texts(events) == expected(2, 7)
        conts = [b["continuation"] for _, b in script.bodies[1:]]
        assert conts == [{"token_ids": [0, 1, 2], "index": 0},
                         {"token_ids": [100, 101, 102], "index": 1}]
        assert all(b["n"] == 1 for _, b in script.bodies[1:])
        assert [e for e in events if isinstance(e, dict)][-1]["usage"]["completion_tokens"] == 14
        assert metric(url, "kvserve:router_migrations_total", outcome="migrated") == 1


def test_a_continuation_that_breaks_again_migrates_again_until_the_limit():
    script = Script(breaks=[(2, "reset"), (2, "error_event"), (1, "reset")])
    with fleet(script, "--migration-limit", "2", replicas=3) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 9})
        assert len({name for name, _ in script.bodies}) == 3
        err = events[-2]["error"]
        assert events[-1] == "[DONE]"
        assert err["code"] == "migration_limit" and "--migration-limit 2" in err["message"]
        assert texts(events)[0] == expected(1, 5)[0]  # 2 + 2 + 1 tokens, none twice
        assert metric(url, "kvserve:router_migrations_total", outcome="migrated") == 2
        assert metric(url, "kvserve:router_migrations_total", reason="reset",
                      outcome="limit") == 1


def test_a_continuation_that_breaks_again_is_continued_by_a_third_replica():
    script = Script(breaks=[(2, "reset"), (3, "drain")])
    with fleet(script, replicas=3) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 9})
        assert texts(events) == expected(1, 9)
        assert script.bodies[2][1]["continuation"]["token_ids"] == [0, 1, 2, 3, 4]


def test_a_stream_over_the_migration_max_tokens_is_not_migrated():
    script = Script(breaks=[(4, "reset")])
    with fleet(script, "--migration-max-tokens", "3") as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 9})
        assert events[-2]["error"]["code"] == "migration_too_long"
        assert len(script.bodies) == 1


def test_migration_limit_0_relays_as_before():
    script = Script(breaks=[(2, "reset")])
    with fleet(script, "--migration-limit", "0") as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 9})
        assert events[-1]["error"]["code"] == "upstream_error"
        assert "return_token_ids" not in script.bodies[0][1]


def test_splice_state_shifts_a_continuations_text_offsets_and_totals_usage():
    state = SpliceState(n=1, chat=False, keep_token_ids=False, want_usage=True)
    head = {"id": "a", "object": "text_completion", "created": 1, "model": "m"}
    first = {**head, "choices": [{"index": 0, "text": "abc", "token_ids": [1, 2],
                                  "logprobs": {"text_offset": [0, 2]}}], "usage": None}
    assert json.loads(state.event(json.dumps(first), False)[6:])["choices"][0]["text"] == "abc"
    state.migrations = 1
    state.start_continuation(0)
    cont = {**head, "id": "b", "created": 2, "choices": [
        {"index": 0, "text": "de", "token_ids": [3], "finish_reason": "stop",
         "logprobs": {"text_offset": [0]}}], "usage": None}
    out = json.loads(state.event(json.dumps(cont), True)[6:])
    assert (out["id"], out["created"]) == ("a", 1)
    assert out["choices"][0]["logprobs"]["text_offset"] == [3]
    usage = {**head, "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                              "total_tokens": 7}}
    assert state.event(json.dumps(usage), True) is None
    final = state.final_events()
    assert json.loads(split_events(final.encode())[0][0])["usage"]["completion_tokens"] == 3
    assert final.endswith("data: [DONE]\n\n")


def test_a_client_error_event_is_passed_through_not_migrated():
    state = SpliceState(n=1, chat=False, keep_token_ids=False, want_usage=False)
    event = '{"error": {"message": "bad", "type": "invalid_request_error", "code": null}}'
    assert state.event(event, False) == f"data: {event}\n\n"


@pytest.mark.parametrize("how", ["reset", "eof", "error_event", "drain"])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_whole_answer_whose_replica_fails_mid_generation_is_continued_invisibly(how, chat):
    """A non-streamed request goes upstream as a stream, so the tokens delivered before the
    break are the router's: the rest is a continuation, the client gets one whole body."""
    script = Script(breaks=[(3, how)])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    ask = {"messages": [{"role": "user", "content": "p"}]} if chat else {"prompt": "p"}
    with fleet(script) as url:
        resp = httpx.post(url + path, timeout=30,
                          json={"model": "fake", "max_tokens": 9, "n": 2, **ask})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        got = {c["index"]: c["message"]["content"] if chat else c["text"]
               for c in body["choices"]}
        assert got == expected(2, 9) and body["id"] == script.bodies[0][0].replace("r", "id-r")
        assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
        assert "token_ids" not in body["choices"][0]  # the router's own ask, not the client's
        assert body["usage"]["completion_tokens"] == 18
        assert all(b["stream"] for _, b in script.bodies)
        conts = sorted((b["continuation"]["index"], b["continuation"]["token_ids"])
                       for _, b in script.bodies[1:])
        assert conts == [(0, [0, 1, 2]), (1, [100, 101, 102])]
        reason = {"reset": "reset", "eof": "eof", "error_event": "error_event",
                  "drain": "drain"}[how]
        assert metric(url, "kvserve:router_migrations_total", reason=reason,
                      outcome="migrated") == 1


def test_a_whole_answer_whose_replica_fails_before_its_first_byte_is_re_issued():
    script = Script(breaks=[(0, "reset")])
    with fleet(script) as url:
        resp = httpx.post(url + "/v1/completions", timeout=30,
                          json={"model": "fake", "prompt": "p", "max_tokens": 5,
                                "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["text"] == expected(1, 5)[0] and choice["token_ids"] == [0, 1, 2, 3, 4]
        assert len({name for name, _ in script.bodies}) == 2
        assert "continuation" not in script.bodies[1][1]


def test_a_whole_answer_with_migration_off_is_relayed_raw():
    """--migration-limit 0: the request goes as the client sent it and the answer comes back
    byte for byte (the replica's own whole body)."""
    script = Script()
    with fleet(script, "--migration-limit", "0") as url:
        resp = httpx.post(url + "/v1/completions", timeout=30,
                          json={"model": "fake", "prompt": "p", "max_tokens": 4})
        assert resp.json()["choices"][0]["text"] == expected(1, 4)[0]
        assert not script.bodies[0][1].get("stream")


def test_a_whole_answer_past_the_migration_limit_is_an_error_answer():
    script = Script(breaks=[(2, "reset"), (2, "reset")])
    with fleet(script, "--migration-limit", "1") as url:
        resp = httpx.post(url + "/v1/completions", timeout=30,
                          json={"model": "fake", "prompt": "p", "max_tokens": 9})
        assert resp.status_code == 502
        assert resp.json()["error"]["code"] == "migration_limit"


def responses_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/responses", timeout=30,
                      json={"model": "fake", "stream": True, **body}) as resp:
        assert resp.status_code == 200 and \
            resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read()
    payloads, rest = split_events(raw)
    assert rest == b""
    return [json.loads(p) for p in payloads]


@pytest.mark.parametrize("how", ["reset", "error_event", "drain"])
def test_a_broken_responses_stream_is_continued_and_retold_as_one(how):
    """/v1/responses goes upstream as its chat completion; the spliced chat stream is retold
    as one Responses stream: one created event, one message item, every delta, numbered
    events, the usage of the whole generation."""
    script = Script(breaks=[(4, how)])
    with fleet(script) as url:
        events = responses_events(url, {"input": "p", "max_output_tokens": 9,
                                        "return_token_ids": True})
        assert [name for name, _ in script.bodies] and \
            all("messages" in b and "input" not in b for _, b in script.bodies)
        assert script.bodies[1][1]["continuation"]["token_ids"] == [0, 1, 2, 3]
        kinds = [e["type"] for e in events]
        assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
        assert kinds.count("response.output_item.added") == 1
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(e["delta"] for e in deltas) == expected(1, 9)[0]
        assert [i for e in deltas for i in e["token_ids"]] == list(range(9))
        done = events[-1]["response"]
        assert done["output"][0]["content"][0]["text"] == expected(1, 9)[0]
        assert done["usage"]["output_tokens"] == 9 and done["status"] == "incomplete"


def test_a_whole_responses_request_is_continued_and_answered_as_a_response():
    script = Script(breaks=[(5, "reset")])
    with fleet(script) as url:
        resp = httpx.post(url + "/v1/responses", timeout=30,
                          json={"model": "fake", "input": "p", "max_output_tokens": 9})
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "response" and body["id"].startswith("resp_")
        assert body["output"][0]["content"][0]["text"] == expected(1, 9)[0]
        assert body["usage"]["output_tokens"] == 9
        assert len(script.bodies) == 2


def test_an_error_event_that_would_repeat_ends_the_stream():
    """A deadline's error event (504) is the client's answer: passed through, then [DONE]."""
    script = Script(breaks=[(2, "timeout_event")])
    with fleet(script) as url:
        events = stream(url, "/v1/completions", {"prompt": "p", "max_tokens": 9})
        assert events[-2]["error"]["type"] == "timeout_error" and events[-1] == "[DONE]"
        assert len(script.bodies) == 1


def test_a_continuation_is_routed_by_its_prompt_and_delivered_tokens(tiny_model_dir):
    """The router scores a continuation over the replica's whole sequence: the blocks of the
    prompt and of the delivered tokens, as a replica that holds them has them cached."""
    from kvserve.engine.sample.tokenizer import load_tokenizer
    from kvserve.service.router.prompt_tokens import prompt_tokens_for

    tok = load_tokenizer(str(tiny_model_dir))
    body = {"messages": [{"role": "user", "content": "Where is the KV cache kept?"}]}
    prompt = prompt_tokens_for(tok, "/v1/chat/completions", body)
    cont = {**body, "continuation": {"token_ids": [5, 6, 7], "index": 1}}
    assert prompt_tokens_for(tok, "/v1/chat/completions", cont) == prompt + [5, 6, 7]
    assert prompt_tokens_for(tok, "/v1/completions",
                             {"prompt": [1, 2], "continuation": {"token_ids": [3]}}) == [1, 2, 3]


def test_text_with_unicode_line_separators_stays_one_event():
    """JSON leaves U+2028, U+0085 and U+001D-like separators of str.splitlines in text as is
    (a random model emits them): an event is cut only at its newline."""
    state = SpliceState(n=1, chat=False, keep_token_ids=False, want_usage=False)
    chunk = {"id": "a", "object": "text_completion", "created": 1, "model": "m", "usage": None,
             "choices": [{"index": 0, "text": "a\u2028b\x85c\u2029d", "token_ids": [1]}]}
    raw = f"data: {json.dumps(chunk, ensure_ascii=False)}\r\n\r\n".encode().replace(
        b"\r\n\r\n", b"\n\n")
    (payload,), rest = split_events(raw)
    out = json.loads(split_events(state.event(payload, False).encode())[0][0])
    assert out["choices"][0]["text"] == "a\u2028b\x85c\u2029d" and rest == b""


def test_a_chat_streams_prompt_token_ids_reach_only_a_client_that_asked():
    """The router asks every replica for token ids; a chat stream's first chunk carries the
    prompt's at its top: kept for a client that asked, dropped otherwise and on continuations."""
    chunk = {"id": "a", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "token_ids": []}], "prompt_token_ids": [1, 2]}
    for keep, continuation, want in ((True, False, True), (False, False, False),
                                     (True, True, False)):
        state = SpliceState(n=1, chat=True, keep_token_ids=keep, want_usage=False)
        out = state.event(json.dumps(chunk), continuation)
        got = json.loads(split_events(out.encode())[0][0]) if out else {}
        assert ("prompt_token_ids" in got) == want, (keep, continuation)
