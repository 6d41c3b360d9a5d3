"""The drain's hand-back on the wire (service/server/handback.py): the agreed event ends a
stream alone (no [DONE]); any other failure still ends with an error event and [DONE]; the
Responses stream keeps the migrate mark on its `error` event."""

from __future__ import annotations

import asyncio
import json

from kvserve.engine.async_engine import EngineDeadError, RequestAbortedError
from kvserve.service.server.engine_streams import stream_failure
from kvserve.service.server.handback import MIGRATE_HEADER, handback_error
from kvserve.service.responses_stream import retell_stream as _events

AGREED = {"error": {"message": "replica draining: stream handed back for migration",
                    "type": "ServiceUnavailableError", "code": 503, "param": None,
                    "kvserve_migrate": True}}


def test_a_request_the_drain_stopped_ends_with_the_agreed_event_alone() -> None:
    text = stream_failure(RequestAbortedError("the server shut down before this request finished"))
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 1 and events[0].startswith("data: ")
    assert json.loads(events[0][6:]) == AGREED


def test_an_engine_death_is_still_an_error_then_done() -> None:
    events = [e for e in stream_failure(EngineDeadError("core gone")).split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert "kvserve_migrate" not in json.loads(events[0][6:])["error"]


def test_a_non_streaming_hand_back_is_a_503_with_the_header() -> None:
    err = handback_error()
    assert (err.status, err.body, err.headers[MIGRATE_HEADER]) == (503, AGREED, "1")


def test_the_responses_stream_keeps_the_migrate_mark() -> None:
    async def chat_writes():
        yield stream_failure(RequestAbortedError("stopped"))

    async def retell() -> list[str]:
        base = {"id": "resp_1", "model": "tiny", "output": []}
        return [e async for e in _events(base, chat_writes())]

    last = json.loads(asyncio.run(retell())[-1].split("data: ", 1)[1])
    assert (last["type"], last["code"], last["kvserve_migrate"]) == ("error", 503, True)
