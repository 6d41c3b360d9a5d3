"""One OpenAI error body, {"error": {message, type, param, code}}, from the server's handlers, the
router's answers and the in-band SSE error event alike: `type` follows the status, `code` is a
string or null."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from kvserve.service.openai_errors import error_body
from kvserve.service.router.app import create_app
from kvserve.service.router.config import RouterConfig
from kvserve.service.sse import sse_error


def test_sse_error_is_one_event_holding_the_error_body():
    event = sse_error(502, "replica r1 failed mid-stream", code="upstream_error")
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: "):]) == {"error": {
        "message": "replica r1 failed mid-stream", "type": "upstream_error", "param": None,
        "code": "upstream_error"}}
    assert json.loads(sse_error(503, "shut down")[len("data: "):]) == error_body(503, "shut down")


def test_error_types_follow_the_status():
    kinds = {s: error_body(s, "m")["error"]["type"] for s in (400, 401, 404, 413, 429, 500, 503)}
    assert kinds == {400: "invalid_request_error", 401: "authentication_error",
                     404: "not_found_error", 413: "invalid_request_error",
                     429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
    assert error_body(418, "m")["error"]["type"] == "invalid_request_error"
    assert error_body(599, "m")["error"]["type"] == "server_error"


def test_router_answers_in_the_same_shape_with_string_codes():
    """No replica answers (a closed port): 503; a bad body is refused before routing: 400."""
    cfg = RouterConfig(replicas=("http://127.0.0.1:9",), policy="least-load", connect_timeout=1)
    with TestClient(create_app(cfg)) as client:
        models = client.get("/v1/models")
        bad = client.post("/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
        too_many = client.post("/v1/completions", json={"prompt": "x", "n": 10_000})
    assert models.status_code == 503
    assert models.json() == {"error": {"message": "no replica answered /v1/models",
                                       "type": "service_unavailable", "param": None,
                                       "code": "service_unavailable"}}
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert too_many.status_code == 400
    assert too_many.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}
