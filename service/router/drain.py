"""The router's drain on SIGTERM: new requests get 503 + Retry-After (and /health says
draining, so the endpoint leaves the load balancer), requests in flight, streams included, get
`shutdown_grace_period` seconds to finish, then the process exits. A stream still running then ends
with an SSE error event (503, `service_unavailable`) so the client knows it was cut, rather than a
dropped connection. A second signal exits at once."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import uvicorn

from kvserve.service.openai_errors import error_body
from kvserve.service.signal_drain import SignalDrainServer

logger = logging.getLogger("kvserve.router")

# After the grace period, how long streams get to send their closing error event.
_CUT_OFF_FLUSH_SECONDS = 1.0


class DrainState:
    """Whether the router drains, and how many requests it is serving (one per router app)."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        # Set when the grace period ends with requests still in flight: a stream still relaying
        # then ends with an SSE error event (service/router/proxy.py), not a cut connection.
        self.cut_off = asyncio.Event()


class DrainMiddleware:
    """Counts requests in flight (a streamed one until its last byte); while draining, answers
    503 + Retry-After to every new request except /metrics."""

    def __init__(self, app: Any, state: DrainState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope["path"] != "/metrics":
            return await _send_draining(send)
        self.state.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


async def _send_draining(send: Any) -> None:
    body = json.dumps(error_body(503, "the router is shutting down; retry on another router",
                                 code="service_unavailable")).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrainingRouterServer(SignalDrainServer):
    """uvicorn that drains the router's requests on SIGTERM/SIGINT before stopping (the signal
    protocol is service/signal_drain.py's)."""

    logger = logger

    def __init__(self, config: uvicorn.Config, state: DrainState, grace: float) -> None:
        super().__init__(config, grace)
        self.state = state

    def stop_accepting(self) -> str:
        self.state.draining = True  # from the signal on, new requests get 503
        return f"draining {self.state.inflight} request(s) in flight"

    async def drain(self) -> None:
        deadline = time.monotonic() + self.grace
        while self.state.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.state.inflight > 0:
            # Streams still relaying end with an error event; give them a moment to send it.
            self.state.cut_off.set()
            deadline = time.monotonic() + _CUT_OFF_FLUSH_SECONDS
            while self.state.inflight > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        logger.info("drained (%d request(s) still in flight cut off); stopping",
                    self.state.inflight)
