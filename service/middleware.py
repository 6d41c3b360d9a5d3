"""ASGI middlewares the server and the router share: the request body limit and API-key auth.

They answer before any route runs, so their errors are written here as raw ASGI messages, in
OpenAI's error shape."""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from typing import Any

from kvserve.service.openai_errors import error_body


async def _send_error(send: Any, status: int, message: str, code: str,
                      headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    """413 for a body over `limit` bytes, whether it declares its length or is chunked."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(send)
        chunks, size = [], 0
        while True:  # buffer the (small, JSON) body so an oversized one never reaches a handler
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    async def _too_large(self, send: Any) -> None:
        await _send_error(send, 413, f"the request body is over the limit of {self.limit} bytes "
                          "(--max-body-bytes)", "request_too_large")


class APIKeyMiddleware:
    """Bearer-token auth on every path except `public` ones (health, metrics by default)."""

    def __init__(self, app: Any, api_key: str, public: Sequence[str]) -> None:
        self.app, self.key, self.public = app, api_key.encode(), tuple(public)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in self.public:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(header, b"Bearer " + self.key):
            return await self.app(scope, receive, send)
        await _send_error(send, 401, "invalid or missing API key: send `Authorization: Bearer "
                          "<key>`", "invalid_api_key", [(b"www-authenticate", b"Bearer")])
