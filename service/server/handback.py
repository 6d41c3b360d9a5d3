"""A draining replica hands its unfinished requests back to the router instead of cutting them
(issue 41): the agreed wire form the router's migration reads as "re-issue elsewhere"."""

from __future__ import annotations

import json
from typing import Any

from kvserve.engine.async_engine import RequestAbortedError
from kvserve.service.openai_errors import APIError

MIGRATE_MESSAGE = "replica draining: stream handed back for migration"
MIGRATE_HEADER = "x-kvserve-migrate"


def handback_body() -> dict[str, Any]:
    """The error body of a handed-back request (the router's migration keys on
    `kvserve_migrate`; the rest is vLLM's error shape, so a plain client sees a 503)."""
    return {"error": {"message": MIGRATE_MESSAGE, "type": "ServiceUnavailableError",
                      "code": 503, "param": None, "kvserve_migrate": True}}


def handed_back(exc: BaseException) -> bool:
    """Whether `exc` ended a request because the server stopped before it finished: the engine
    aborts what still runs when the drain timeout is over (engine death stays an error)."""
    return isinstance(exc, RequestAbortedError)


def handback_event() -> str:
    """The last event of a handed-back stream; nothing follows it (no [DONE])."""
    return f"data: {json.dumps(handback_body())}\n\n"


def handback_error() -> APIError:
    """HTTP 503 for a non-streaming request still running at the drain deadline."""
    return APIError(503, MIGRATE_MESSAGE, headers={MIGRATE_HEADER: "1", "Retry-After": "1"},
                    body=handback_body())
