"""Proxying a request to the replicas of its ranking: the first that answers streams back, raw;
one that fails before its first byte is marked down and the next is tried. Hop-by-hop headers
are recomputed on each leg."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse

from kvserve.service.router.config import RouterConfig
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.routing import RouteInfo
from kvserve.service.routing_policy import Candidate
from kvserve.service.sse import sse_error

logger = logging.getLogger("kvserve.router")

# Hop-by-hop and length headers are recomputed on each leg of the proxy.
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                "upgrade", "proxy-authorization", "proxy-authenticate", "trailer",
                "accept-encoding"}
# The router's own server sets these; raw bytes are relayed, so no content-encoding is added.
_OWN_HEADERS = {"date", "server"}
_RETRY_STATUS = {502, 503, 504}
_DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class NoReplicaError(RuntimeError):
    """No replica is known or every one failed before answering."""


class Proxy:
    """The router's HTTP client to the replicas; one per router process."""

    def __init__(self, cfg: RouterConfig, replicas: ReplicaSet, metrics: RouterMetrics) -> None:
        self.cfg, self.replicas, self.metrics = cfg, replicas, metrics
        self.http: httpx.AsyncClient | None = None

    def start(self) -> None:
        timeout = httpx.Timeout(self.cfg.read_timeout, connect=self.cfg.connect_timeout)
        # Idle connections expire before uvicorn's 5 s keep-alive, so a request rarely races a
        # server-side close.
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=2048, max_keepalive_connections=256, keepalive_expiry=2.0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def forward(self, method: str, path: str, query: str, body: bytes, headers: Any,
                      ranking: Sequence[Candidate], policy: str,
                      route: RouteInfo | None = None) -> Response:
        """Send to the first candidate that answers; retry the next one on failure before byte 1."""
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        for cand in ranking:
            opened = await self._open(cand, method, path, query, body, fwd)
            if opened is None and not self.replicas.is_down(cand.replica_id):
                # A dropped connection, not a dead replica: one more try on a fresh connection.
                opened = await self._open(cand, method, path, query, body, fwd)
            if opened is None:
                continue
            resp, first, chunks = opened
            self.metrics.requests.labels(cand.replica_id, policy).inc()
            if route is not None:
                matched = min(route.matched.get(cand.replica_id, 0), route.prompt_tokens)
                self.metrics.matched_tokens.observe(matched)
                self.metrics.prompt_tokens.inc(route.prompt_tokens)
            return self._stream_back(cand, resp, first, chunks, route)
        raise NoReplicaError(f"no replica could take the request ({len(ranking)} tried)")

    async def _open(self, cand: Candidate, method: str, path: str, query: str, body: bytes,
                    headers: dict[str, str]
                    ) -> tuple[httpx.Response, bytes, AsyncIterator[bytes]] | None:
        """Send the request and read its first body chunk; None on failure (the replica is marked
        down unless only the connection dropped)."""
        assert self.http is not None
        url = cand.url.rstrip("/") + path + (f"?{query}" if query else "")
        self.replicas.acquire(cand.replica_id)
        resp = None
        try:
            req = self.http.build_request(method, url, content=body, headers=headers)
            resp = await self.http.send(req, stream=True)
            if resp.status_code in _RETRY_STATUS:
                raise httpx.HTTPStatusError(f"status {resp.status_code}", request=req,
                                            response=resp)
            chunks = resp.aiter_raw()
            first = await anext(chunks, b"")
            return resp, first, chunks
        except httpx.HTTPError as exc:
            self.replicas.release(cand.replica_id)
            if resp is not None:
                await resp.aclose()
            logger.warning("replica %s failed before answering (%s: %s); trying the next one",
                           cand.replica_id, type(exc).__name__, exc)
            self.metrics.upstream_errors.labels(cand.replica_id, "before_first_byte").inc()
            self.metrics.retries.labels(cand.replica_id).inc()
            if isinstance(exc, _DOWN_ERRORS) or resp is not None:
                # Refused, unreachable or answering 502/503/504. A dropped connection alone may be
                # a keep-alive race with a healthy replica: the next connect attempt will tell.
                self.replicas.mark_down(cand.replica_id)
            return None

    def _stream_back(self, cand: Candidate, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], route: RouteInfo | None) -> Response:
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in _HOP_HEADERS and k.lower() not in _OWN_HEADERS}
        headers["x-kvserve-replica"] = cand.replica_id
        if route is not None:
            headers["x-kvserve-predicted-matched-tokens"] = str(
                min(route.matched.get(cand.replica_id, 0), route.prompt_tokens))
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(cand, resp, first, chunks, sse),
                                 status_code=resp.status_code, headers=headers)

    async def _relay(self, cand: Candidate, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], sse: bool) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:
            logger.warning("replica %s failed mid-response: %s", cand.replica_id, exc)
            self.metrics.upstream_errors.labels(cand.replica_id, "mid_stream").inc()
            self.replicas.mark_down(cand.replica_id)
            if not sse:
                raise  # the client sees a broken response, never a silently short one
            yield sse_error(502, f"replica {cand.replica_id} failed mid-stream: {exc}",
                            code="upstream_error").encode()
        finally:
            self.replicas.release(cand.replica_id)
            await resp.aclose()

    async def merged_models(self, headers: Any) -> dict[str, Any]:
        assert self.http is not None
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        infos = self.replicas.routable()
        answers = await asyncio.gather(
            *(self.http.get(i.url.rstrip("/") + "/v1/models", headers=fwd) for i in infos),
            return_exceptions=True)
        merged: dict[str, Any] = {}
        for ans in answers:
            if isinstance(ans, httpx.Response) and ans.status_code == 200:
                for model in ans.json().get("data", []):
                    merged.setdefault(model["id"], model)
        return {"object": "list", "data": list(merged.values())}

