"""Request migration: when a replica's stream breaks before its end (connection reset, EOF
without a finish, an SSE error event from a dying engine, a drain hand-back), the router
re-issues each unfinished choice to another replica as a continuation (the prompt plus the token
ids already delivered) and splices its chunks into the client's one stream
(migration_state.py rewrites them). Whole (non-streamed) answers are re-issued by the proxy's
retry before the first byte (service/router/proxy.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.migration_state import SpliceState, StreamBroken, split_events
from kvserve.service.router.proxy import ClientWatch, NoReplicaError, Opened, Proxy
from kvserve.service.router.routing import RouteInfo, Router
from kvserve.service.routing_policy import Candidate
from kvserve.service.sse import SSE_DONE, sse_error

logger = logging.getLogger("kvserve.router")
STREAMED_PATHS = ("/v1/completions", "/v1/chat/completions")


def migratable(cfg: RouterConfig, path: str, body: dict[str, Any]) -> bool:
    """A streamed completion or chat request of one prompt the router can continue elsewhere
    (echo and batched prompts would repeat their prompt part: relayed as before)."""
    if cfg.migration_limit <= 0 or path not in STREAMED_PATHS or not body.get("stream"):
        return False
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and len(prompt) > 1 and \
        isinstance(prompt[0], (list, str))
    best_of = body.get("best_of")
    return not batched and not body.get("echo") and best_of in (None, body.get("n") or 1)


@dataclass
class Leg:
    """One upstream stream: the original request (`choice` None) or one choice's continuation."""

    opened: Opened
    choice: int | None = None

    @property
    def replica(self) -> str:
        return self.opened.cand.replica_id


@dataclass
class Migrating:
    """One client request being relayed: its body, the client's view, what failed so far."""

    path: str
    query: str
    body: dict[str, Any]
    headers: Any
    prompt_tokens: int
    state: SpliceState
    failed: set[str] = field(default_factory=set)
    pending: list[int] = field(default_factory=list)  # choices waiting for a continuation

    def upstream(self, continuation: tuple[int, list[int]] | None = None) -> dict[str, Any]:
        """The body a replica gets: token ids on each chunk, usage at the end (the client's
        wishes are restored by `state`), and for a continuation one choice's delivered ids."""
        body = {**self.body, "return_token_ids": True,
                "stream_options": {**(self.body.get("stream_options") or {}),
                                   "include_usage": True}}
        if continuation is not None:
            index, ids = continuation
            body.update(n=1, continuation={"token_ids": ids, "index": index})
            body.pop("best_of", None)
            # A remote prefill's blocks were for the first leg (--policy pd): prefill here.
            body.pop("kv_transfer_params", None)
        return body


class Migrator:
    """Relays streamed completions and chat completions, migrating them when a replica fails."""

    def __init__(self, cfg: RouterConfig, router: Router, proxy: Proxy) -> None:
        self.cfg, self.router, self.proxy = cfg, router, proxy
        self.metrics = router.metrics

    async def forward(self, path: str, query: str, body: dict[str, Any], headers: Any,
                      ranking: list[Candidate], policy: str, route: RouteInfo | None,
                      watch: ClientWatch | None) -> Response:
        n = int(body.get("n") or 1)
        state = SpliceState(n=n, chat=path.endswith("/chat/completions"),
                            keep_token_ids=bool(body.get("return_token_ids")),
                            want_usage=bool((body.get("stream_options") or {}).get(
                                "include_usage")))
        req = Migrating(path, query, body, headers, route.prompt_tokens if route else 0, state)
        opened = await self.proxy.open_first("POST", path, query, _encode(req.upstream()),
                                             headers, ranking, policy, route, watch)
        resp = opened.resp
        if resp.status_code != 200 or \
                not resp.headers.get("content-type", "").startswith("text/event-stream"):
            return self.proxy._stream_back(*opened, route)  # an error answer: relayed as is
        return StreamingResponse(self._relay(req, Leg(opened)), status_code=200,
                                 headers=self.proxy.response_headers(opened.cand, resp, route))

    async def _relay(self, req: Migrating, leg: Leg | None) -> AsyncIterator[bytes]:
        """The client's stream: each leg's events, a migration where one breaks."""
        state = req.state
        while leg is not None:
            try:
                async for event in self._events(leg, state):
                    yield event.encode()
                if self._cut_off():
                    yield _router_cut_off()
                    return
                if state.ended_by_error:  # a client error or a deadline: it would repeat
                    yield SSE_DONE.encode()
                    return
                unfinished = state.unfinished() if leg.choice is None else \
                    [leg.choice] if not state.choices[leg.choice].finished else []
                if unfinished:
                    raise StreamBroken("eof", "the stream ended before its finish")
            except (StreamBroken, httpx.HTTPError) as exc:
                failure = exc if isinstance(exc, StreamBroken) else StreamBroken("reset", str(exc))
                error = self._on_break(req, leg, failure)
                if error is not None:
                    yield error.encode()
                    return
            leg, error = await self._next_leg(req)
            if error is not None:
                yield error.encode()
                return
        yield state.final_events().encode()

    async def _events(self, leg: Leg, state: SpliceState) -> AsyncIterator[str]:
        """The client's events of one leg, until its [DONE] or end; the leg is closed after."""
        opened = leg.opened
        chunks = opened.chunks
        if self.proxy.drain is not None:
            chunks = self.proxy._until_cut_off(chunks, self.proxy.drain.cut_off)
        buffer = opened.first
        try:
            while True:
                payloads, buffer = split_events(buffer)
                # one write per upstream chunk, as the replica wrote its events
                outs: list[str] = []
                for payload in payloads:
                    if payload == "[DONE]":
                        if outs:
                            yield "".join(outs)
                        return
                    out = state.event(payload, continuation=leg.choice is not None)
                    if out is not None:
                        outs.append(out)
                if outs:
                    yield "".join(outs)
                chunk = await anext(chunks, None)
                if chunk is None:
                    return
                buffer += chunk
        except asyncio.CancelledError:  # the client left mid-response
            self.metrics.client_disconnects.inc()
            raise
        finally:
            self.proxy.replicas.release(leg.replica)
            with anyio.CancelScope(shield=True):  # the replica must see the close and abort
                await opened.resp.aclose()

    def _cut_off(self) -> bool:
        return self.proxy.drain is not None and self.proxy.drain.cut_off.is_set()

    def _on_break(self, req: Migrating, leg: Leg, failure: StreamBroken) -> str | None:
        """Book a broken leg; the error event that ends the stream when it cannot migrate."""
        state, rid = req.state, leg.replica
        self.metrics.upstream_errors.labels(rid, "mid_stream").inc()
        self.proxy.replicas.mark_down(rid)
        req.failed.add(rid)
        todo = state.unfinished() if leg.choice is None else [leg.choice]
        req.pending = todo + [i for i in req.pending if i not in todo]
        length = req.prompt_tokens + state.delivered()
        if state.migrations >= self.cfg.migration_limit:
            outcome = "limit"
            message = (f"replica {rid} failed mid-stream ({failure.detail}) and the request was "
                       f"already migrated {state.migrations} time(s): the migration limit "
                       f"(--migration-limit {self.cfg.migration_limit}) is reached")
        elif self.cfg.migration_max_tokens and length > self.cfg.migration_max_tokens:
            outcome = "too_long"
            message = (f"replica {rid} failed mid-stream ({failure.detail}); {length} tokens are "
                       f"over --migration-max-tokens {self.cfg.migration_max_tokens}")
        else:
            state.migrations += 1
            logger.info("migrating a stream from replica %s (%s: %s) after %d delivered "
                        "token(s), choice(s) %s; migration %d of at most %d", rid,
                        failure.reason, failure.detail, state.delivered(), req.pending,
                        state.migrations, self.cfg.migration_limit)
            self.metrics.migrations.labels(failure.reason, "migrated").inc()
            return None
        self.metrics.migrations.labels(failure.reason, outcome).inc()
        logger.warning("not migrating a stream: %s", message)
        return sse_error(502, message, code=f"migration_{outcome}") + SSE_DONE

    async def _next_leg(self, req: Migrating) -> tuple[Leg | None, str | None]:
        """The continuation of the next pending choice (None when none is left), or the error
        event that ends the stream when no replica takes it."""
        if not req.pending:
            return None, None
        index = req.pending.pop(0)
        state = req.state
        body = req.upstream((index, list(state.choices[index].token_ids)))
        route = await self.router.route(req.path, body, req.headers)
        ranking = [c for c in route.decision.ranking if c.replica_id not in req.failed]
        try:
            opened = await self.proxy.open_first("POST", req.path, req.query, _encode(body),
                                                 req.headers, ranking, route.decision.applied,
                                                 route)
        except NoReplicaError as exc:
            self.metrics.migrations.labels("continuation", "no_replica").inc()
            return None, sse_error(503, f"no replica could continue the stream: {exc}",
                                   code="migration_no_replica") + SSE_DONE
        if opened.resp.status_code != 200:
            text = (await opened.resp.aread()).decode(errors="replace")[:500]
            self.proxy.replicas.release(opened.cand.replica_id)
            await opened.resp.aclose()
            self.metrics.migrations.labels("continuation", "refused").inc()
            return None, sse_error(502, f"replica {opened.cand.replica_id} refused the "
                                   f"continuation ({opened.resp.status_code}): {text}",
                                   code="migration_refused") + SSE_DONE
        state.start_continuation(index)
        return Leg(opened, index), None


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _router_cut_off() -> bytes:
    return (sse_error(503, "the router shut down before the stream finished "
                      "(--shutdown-grace-period); retry the request",
                      code="service_unavailable") + SSE_DONE).encode()
