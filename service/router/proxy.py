"""Proxying a request to the replicas of its ranking: the first that answers streams back, raw;
one that fails before its first byte is marked down and the next is tried. Hop-by-hop headers
are recomputed on each leg.

Deadlines: a replica gets `connect_timeout` to accept the connection and `first_byte_timeout` to
start answering; past that the router asks its /health (same limit), and a replica that does not
answer that either is hung (a frozen process still accepts connections): it is marked down and the
request goes to the next one. A replica busy with a long non-streamed answer still answers /health,
so it is left alone. Once a byte went back to the client there is no retry. A client that leaves
closes the replica's connection, which is how the replica learns to abort the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from kvserve.service.router.config import RouterConfig
from kvserve.service.router.drain import DrainState
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.routing import RouteInfo
from kvserve.service.routing_policy import Candidate
from kvserve.service.sse import SSE_DONE, sse_error

logger = logging.getLogger("kvserve.router")

# Hop-by-hop and length headers are recomputed on each leg of the proxy.
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                "upgrade", "proxy-authorization", "proxy-authenticate", "trailer",
                "accept-encoding"}
# The router's own server sets these; raw bytes are relayed, so no content-encoding is added.
_OWN_HEADERS = {"date", "server"}
_RETRY_STATUS = {502, 503, 504}
_DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def forward_headers(headers: Any) -> dict[str, str]:
    """A client's request headers as a replica gets them (hop-by-hop ones recomputed)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


class Opened(NamedTuple):
    """A replica's response once its first chunk arrived."""

    cand: Candidate
    resp: httpx.Response
    first: bytes
    chunks: AsyncIterator[bytes]


class NoReplicaError(RuntimeError):
    """No replica is known or every one failed before answering."""


class ClientGoneError(RuntimeError):
    """The client disconnected before the replica started answering."""


class UpstreamHungError(httpx.TransportError):
    """A replica accepted the request but neither answered it nor its /health in time."""


class ClientWatch:
    """Resolves when the client disconnects, while the router waits for a replica's first byte
    (after that, the streaming response watches for it). `stop()` before the response is sent,
    so only one reader waits on the connection."""

    def __init__(self, receive: Callable[[], Awaitable[dict]]) -> None:
        self.gone = asyncio.ensure_future(self._wait(receive))

    @staticmethod
    async def _wait(receive: Callable[[], Awaitable[dict]]) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def stop(self) -> None:
        self.gone.cancel()
        await asyncio.gather(self.gone, return_exceptions=True)


class Proxy:
    """The router's HTTP client to the replicas; one per router process."""

    def __init__(self, cfg: RouterConfig, replicas: ReplicaSet, metrics: RouterMetrics,
                 drain: DrainState | None = None) -> None:
        self.cfg, self.replicas, self.metrics = cfg, replicas, metrics
        self.drain = drain
        self.http: httpx.AsyncClient | None = None

    def start(self) -> None:
        timeout = httpx.Timeout(self.cfg.read_timeout, connect=self.cfg.connect_timeout,
                                pool=self.cfg.connect_timeout)
        # Idle connections expire before uvicorn's 5 s keep-alive, so a request rarely races a
        # server-side close.
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=2048, max_keepalive_connections=256, keepalive_expiry=2.0))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def forward(self, method: str, path: str, query: str, body: bytes, headers: Any,
                      ranking: Sequence[Candidate], policy: str,
                      route: RouteInfo | None = None, watch: ClientWatch | None = None,
                      on_missing: Callable[[Candidate], Awaitable[bool]] | None = None
                      ) -> Response:
        """Send to the first candidate that answers and relay its answer raw (`open_first`)."""
        opened = await self.open_first(method, path, query, body, headers, ranking, policy,
                                       route, watch, on_missing)
        return self._stream_back(*opened, route)

    async def open_first(self, method: str, path: str, query: str, body: bytes, headers: Any,
                         ranking: Sequence[Candidate], policy: str,
                         route: RouteInfo | None = None, watch: ClientWatch | None = None,
                         on_missing: Callable[[Candidate], Awaitable[bool]] | None = None
                         ) -> Opened:
        """The first candidate that answers, its response and first chunk; retry the next one on
        failure before byte 1 (NoReplicaError when none answers). ClientGoneError when `watch`
        sees the client leave first. `on_missing` (a registered LoRA adapter's request): a
        replica answering 404 has the adapter loaded again by it and gets the request once more;
        when that load fails (or the adapter is gone again) the next replica is tried. The
        caller owns the response: `release` its replica and close it."""
        fwd = forward_headers(headers)
        for cand in ranking:
            opened = await self._open(cand, method, path, query, body, fwd, watch)
            if opened is None and not self.replicas.is_down(cand.replica_id):
                # A dropped connection, not a dead replica: one more try on a fresh connection.
                opened = await self._open(cand, method, path, query, body, fwd, watch)
            if opened is not None and opened[0].status_code == 404 and on_missing is not None:
                await self._discard(cand, opened[0])
                opened = None
                if await on_missing(cand):
                    opened = await self._open(cand, method, path, query, body, fwd, watch)
                if opened is not None and opened[0].status_code == 404:
                    # Evicted again before the request got there (more adapters in demand than
                    # the replica holds): the next replica, never the 404 of a registered one.
                    await self._discard(cand, opened[0])
                    opened = None
            if opened is None:
                continue
            resp, first, chunks = opened
            self.metrics.requests.labels(cand.replica_id, policy).inc()
            if route is not None:
                device, host = route.split(cand.replica_id)
                self.metrics.matched_tokens.observe(device + host)
                self.metrics.matched_tokens_by_tier.labels("device").inc(device)
                self.metrics.matched_tokens_by_tier.labels("host").inc(host)
                self.metrics.prompt_tokens.inc(route.prompt_tokens)
            return Opened(cand, resp, first, chunks)
        raise NoReplicaError(f"no replica could take the request ({len(ranking)} tried)")

    async def _discard(self, cand: Candidate, resp: httpx.Response) -> None:
        """Drop an opened response that will not be relayed."""
        self.replicas.release(cand.replica_id)
        await resp.aclose()

    async def _open(self, cand: Candidate, method: str, path: str, query: str, body: bytes,
                    headers: dict[str, str], watch: ClientWatch | None = None
                    ) -> tuple[httpx.Response, bytes, AsyncIterator[bytes]] | None:
        """Send the request and read its first body chunk; None on failure (the replica is marked
        down unless only the connection dropped)."""
        assert self.http is not None
        url = cand.url.rstrip("/") + path + (f"?{query}" if query else "")
        self.replicas.acquire(cand.replica_id)
        box: list[httpx.Response] = []  # the response once its headers arrived

        async def first_byte() -> tuple[httpx.Response, bytes, AsyncIterator[bytes]]:
            assert self.http is not None
            req = self.http.build_request(method, url, content=body, headers=headers)
            box.append(await self.http.send(req, stream=True))
            if box[0].status_code in _RETRY_STATUS:
                raise httpx.HTTPStatusError(f"status {box[0].status_code}", request=req,
                                            response=box[0])
            chunks = box[0].aiter_raw()
            return box[0], await anext(chunks, b""), chunks

        try:
            return await self._within_deadline(cand, first_byte(), watch)
        except (httpx.HTTPError, ClientGoneError) as exc:
            self.replicas.release(cand.replica_id)
            resp = box[0] if box else None
            if resp is not None:
                await resp.aclose()
            if isinstance(exc, ClientGoneError):
                raise
            logger.warning("replica %s failed before answering (%s: %s); trying the next one",
                           cand.replica_id, type(exc).__name__, exc)
            self.metrics.upstream_errors.labels(cand.replica_id, "before_first_byte").inc()
            self.metrics.retries.labels(cand.replica_id).inc()
            if resp is not None and resp.headers.get("x-kvserve-migrate"):
                # A draining replica handed a whole (non-streamed) request back: the next
                # replica runs it, invisibly to the client.
                self.metrics.migrations.labels("drain", "retried").inc()
                logger.info("replica %s handed a request back (drain); re-issuing it",
                            cand.replica_id)
            if isinstance(exc, (*_DOWN_ERRORS, UpstreamHungError)) or resp is not None:
                # Refused, unreachable or answering 502/503/504. A dropped connection alone may be
                # a keep-alive race with a healthy replica: the next connect attempt will tell.
                self.replicas.mark_down(cand.replica_id)
            return None

    async def _within_deadline(self, cand: Candidate, work: Awaitable[Any],
                               watch: ClientWatch | None) -> Any:
        """`work`, unless the client leaves (ClientGoneError) or the replica is hung: no first
        byte within `first_byte_timeout` and no /health answer within it either."""
        task = asyncio.ensure_future(work)
        waits: set[asyncio.Future] = {task} | ({watch.gone} if watch is not None else set())
        try:
            while True:
                done, _ = await asyncio.wait(waits, timeout=self.cfg.first_byte_timeout,
                                             return_when=asyncio.FIRST_COMPLETED)
                if task in done:
                    return task.result()
                if watch is not None and watch.gone in done:
                    raise ClientGoneError("the client disconnected")
                if not await self._answers_health(cand):
                    raise UpstreamHungError(
                        f"no first byte and no /health answer within {self.cfg.first_byte_timeout}"
                        " s (--upstream-first-byte-timeout)")
        finally:
            if not task.done():
                task.cancel()  # closes the replica's connection: it aborts the request
                await asyncio.gather(task, return_exceptions=True)

    async def _answers_health(self, cand: Candidate) -> bool:
        """True when the replica's HTTP server answers /health at all (503 included: alive)."""
        assert self.http is not None
        try:
            await self.http.get(cand.url.rstrip("/") + "/health",
                                timeout=self.cfg.first_byte_timeout)
        except httpx.HTTPError:
            return False
        return True

    def _stream_back(self, cand: Candidate, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], route: RouteInfo | None) -> Response:
        headers = self.response_headers(cand, resp, route)
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._relay(cand, resp, first, chunks, sse),
                                 status_code=resp.status_code, headers=headers)

    def response_headers(self, cand: Candidate, resp: httpx.Response,
                         route: RouteInfo | None) -> dict[str, str]:
        """The replica's response headers as the client gets them."""
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in _HOP_HEADERS and k.lower() not in _OWN_HEADERS
                   and not k.lower().startswith("x-kvserve-")}
        if self.cfg.expose_routing_headers:  # they reveal what other tenants have cached
            headers["x-kvserve-replica"] = cand.replica_id
            if route is not None:
                device, host = route.split(cand.replica_id)
                headers["x-kvserve-predicted-matched-tokens"] = str(device + host)
                headers["x-kvserve-predicted-host-tokens"] = str(host)
                if route.pd_decision is not None:  # --policy pd
                    headers["x-kvserve-pd-decision"] = route.pd_decision
                    if route.pd_prefilled_by is not None:
                        headers["x-kvserve-prefill-replica"] = route.pd_prefilled_by
        return headers

    async def _relay(self, cand: Candidate, resp: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], sse: bool) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            if sse and self.drain is not None:
                async for chunk in self._until_cut_off(chunks, self.drain.cut_off):
                    yield chunk
                if self.drain.cut_off.is_set():
                    yield sse_error(503, "the router shut down before the stream finished "
                                    "(--shutdown-grace-period); retry the request",
                                    code="service_unavailable").encode() + SSE_DONE.encode()
            else:
                async for chunk in chunks:
                    yield chunk
        except asyncio.CancelledError:  # the client left mid-response
            self.metrics.client_disconnects.inc()
            raise
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
            # Runs when the client left too (the stream is cancelled): shield the close so the
            # replica's connection really closes and the replica aborts the request.
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    @staticmethod
    async def _until_cut_off(chunks: AsyncIterator[bytes], cut_off: asyncio.Event
                             ) -> AsyncIterator[bytes]:
        """The replica's chunks until it ends or the drain's grace period does (`cut_off`)."""
        cut = asyncio.ensure_future(cut_off.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(anext(chunks, None))
                await asyncio.wait({nxt, cut}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    await asyncio.gather(nxt, return_exceptions=True)
                    return
                chunk = nxt.result()
                if chunk is None:
                    return
                yield chunk
        finally:
            cut.cancel()

    async def merged_models(self, headers: Any) -> dict[str, Any]:
        assert self.http is not None
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        infos = self.replicas.routable()
        # A hung replica must not hold the merged list: it is left out after the deadline.
        timeout = httpx.Timeout(self.cfg.first_byte_timeout, connect=self.cfg.connect_timeout)
        answers = await asyncio.gather(
            *(self.http.get(i.url.rstrip("/") + "/v1/models", headers=fwd, timeout=timeout)
              for i in infos), return_exceptions=True)
        merged: dict[str, Any] = {}
        for ans in answers:
            if isinstance(ans, httpx.Response) and ans.status_code == 200:
                for model in ans.json().get("data", []):
                    merged.setdefault(model["id"], model)
        return {"object": "list", "data": list(merged.values())}

