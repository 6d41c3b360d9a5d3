"""Request migration: when a replica's stream breaks before its end (connection reset, EOF
without a finish, an SSE error event from a dying engine, a drain hand-back), the router
re-issues each unfinished choice to another replica as a continuation (the prompt plus the token
ids already delivered) and splices its chunks into the client's one stream
(migration_state.py rewrites them).

Whole (non-streamed) requests are asked of the replicas as streams too, and the router answers
the client with the body those chunks make (whole_answer.py): a replica that dies mid-generation
leaves the router the tokens it delivered, so the rest is continued elsewhere, invisibly. A
/v1/responses request is sent as its chat completion (the replica's own translation,
service/responses_request.py) and retold as Responses events or a Response object
(service/responses_stream.py, as the replica retells it)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kvserve.service.responses_request import ResponsesRequest
from kvserve.service.responses_stream import finished_response, response_base, retell_stream
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.migration_state import SpliceState, StreamBroken, split_events
from kvserve.service.router.proxy import ClientWatch, NoReplicaError, Opened, Proxy
from kvserve.service.router.routing import RouteInfo, Router
from kvserve.service.router.whole_answer import WholeAnswer
from kvserve.service.routing_policy import Candidate
from kvserve.service.sse import SSE_DONE, sse_error

logger = logging.getLogger("kvserve.router")
CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"
MIGRATABLE_PATHS = ("/v1/completions", CHAT_PATH, RESPONSES_PATH)


def migratable(cfg: RouterConfig, path: str, body: dict[str, Any]) -> bool:
    """A completion, chat or Responses request of one prompt, streamed or not, the router can
    continue elsewhere (echo and batched prompts would repeat their prompt part; beam search,
    best_of > n and prompt_logprobs have no stream to continue: relayed as before)."""
    if cfg.migration_limit <= 0 or path not in MIGRATABLE_PATHS:
        return False
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and len(prompt) > 1 and \
        isinstance(prompt[0], (list, str))
    best_of = body.get("best_of")
    return not batched and not body.get("echo") and best_of in (None, body.get("n") or 1) \
        and not body.get("use_beam_search") and body.get("prompt_logprobs") is None


def upstream_form(path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The path and body the replicas get: a Responses request as its chat completion."""
    if path == RESPONSES_PATH:
        return CHAT_PATH, ResponsesRequest.model_validate(body).chat_body()
    return path, body


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
        """The body a replica gets: a stream (a whole answer's too), token ids on each chunk,
        usage at the end (the client's wishes are restored by `state`), and for a continuation
        one choice's delivered ids."""
        body = {**self.body, "stream": True, "return_token_ids": True,
                "stream_options": {**(self.body.get("stream_options") or {}),
                                   "include_usage": True}}
        if continuation is not None:
            index, ids = continuation
            body.update(n=1, continuation={"token_ids": ids, "index": index})
            body.pop("best_of", None)
            # --policy pd: the prefill replica's KV was for the first leg; the continuation's
            # replica prefills prompt + delivered tokens itself
            body.pop("kv_transfer_params", None)
            # A remote prefill's blocks were for the first leg (--policy pd): prefill here.
            body.pop("kv_transfer_params", None)
        return body


class Migrator:
    """Relays completions, chat completions and Responses, migrating them when a replica fails."""

    def __init__(self, cfg: RouterConfig, router: Router, proxy: Proxy) -> None:
        self.cfg, self.router, self.proxy = cfg, router, proxy
        self.metrics = router.metrics

    async def forward(self, path: str, query: str, body: dict[str, Any], headers: Any,
                      ranking: list[Candidate], policy: str, route: RouteInfo | None,
                      watch: ClientWatch | None) -> Response:
        whole = not body.get("stream")
        retell = ResponsesRequest.model_validate(body) if path == RESPONSES_PATH else None
        up_path, up_body = upstream_form(path, body)
        state = SpliceState(n=int(up_body.get("n") or 1), chat=up_path == CHAT_PATH,
                            keep_token_ids=bool(up_body.get("return_token_ids")),
                            want_usage=whole or bool((up_body.get("stream_options") or {}).get(
                                "include_usage")))
        req = Migrating(up_path, query, up_body, headers, route.prompt_tokens if route else 0,
                        state)
        opened = await self.proxy.open_first("POST", up_path, query, _encode(req.upstream()),
                                             headers, ranking, policy, route, watch)
        resp = opened.resp
        if resp.status_code != 200 or \
                not resp.headers.get("content-type", "").startswith("text/event-stream"):
            return self.proxy._stream_back(*opened, route)  # an error answer: relayed as is
        headers_out = self.proxy.response_headers(opened.cand, resp, route)
        relay = self._relay(req, Leg(opened))
        if whole:
            headers_out.pop("content-type", None)
            return await self._whole(state, relay, watch, headers_out, retell)
        if retell is not None:
            relay = _retold(retell, relay)
        return StreamingResponse(relay, status_code=200, headers=headers_out)

    async def _whole(self, state: SpliceState, relay: AsyncIterator[bytes],
                     watch: ClientWatch | None, headers: dict[str, str],
                     retell: ResponsesRequest | None) -> Response:
        """The non-streamed answer the relayed (and maybe migrated) stream makes; 499 when the
        client leaves first (the relay's close tells the replica to abort)."""
        answer = WholeAnswer(chat=state.chat, keep_token_ids=state.keep_token_ids)

        async def collect() -> None:
            async for raw in relay:
                answer.feed(raw)

        task = asyncio.ensure_future(collect())
        waits: set[asyncio.Future] = {task} | ({watch.gone} if watch is not None else set())
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        task.result()
        if answer.error is not None:
            return JSONResponse(answer.error, status_code=answer.status(), headers=headers)
        body = answer.body()
        if retell is not None:
            base = {**response_base(retell), "model": body["model"]}
            body = finished_response(base, body["choices"][0], body.get("usage"))
        return JSONResponse(body, headers=headers)

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


async def _retold(req: ResponsesRequest, relay: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The Responses stream's events for the relayed chat stream; the relay is closed after
    (the client leaving must close the replica's stream too)."""
    try:
        async for event in retell_stream(response_base(req), relay):
            yield event.encode()
    finally:
        with anyio.CancelScope(shield=True):
            await relay.aclose()  # type: ignore[attr-defined]


def _router_cut_off() -> bytes:
    return (sse_error(503, "the router shut down before the stream finished "
                      "(--shutdown-grace-period); retry the request",
                      code="service_unavailable") + SSE_DONE).encode()
