"""Prefix-aware router: picks a replica per request from the Redis prefix index and proxies to it.

`kvserve router --redis-url redis://... --service-name demo` (or `python -m kvserve.service.router`)
serves the OpenAI API on one port in front of many `kvserve serve` replicas. Replicas come from
Redis heartbeats (service/prefix_index.py) or a static `--replicas url,url`. Without Redis it keeps
routing by least load over the last known replicas and reports `kvserve_router:redis_up 0`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from pydantic import ValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from redis.exceptions import RedisError

from kvserve.engine.errors import InvalidRequestError
from kvserve.service.api_server import BodyLimitMiddleware
from kvserve.service.cli import add_limit_args, limits_from_args
from kvserve.service.errors import APIError, error_response, validation_error
from kvserve.service.prefix_index import PrefixIndex, ReplicaInfo, ReplicaMatch
from kvserve.service.protocol import (ChatCompletionRequest, CompletionRequest, RequestLimits,
                                      parse_json_object)
from kvserve.service.routing_policy import POLICIES, Candidate, Decision, PolicyConfig, decide

logger = logging.getLogger("kvserve.router")

# Hop-by-hop and length headers are recomputed on each leg of the proxy.
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                "upgrade", "proxy-authorization", "proxy-authenticate", "trailer",
                "accept-encoding"}
# The router's own server sets these; raw bytes are relayed, so no content-encoding is added.
_OWN_HEADERS = {"date", "server"}
_RETRY_STATUS = {502, 503, 504}
_DOWN_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


class NoReplicaError(RuntimeError):
    """No replica is known or every one failed before answering."""


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    redis_url: str | None = None
    service_name: str = "default"
    replicas: tuple[str, ...] = ()  # static replica URLs (or the fallback set when Redis is down)
    policy: str = "prefix"
    tokenizer: str | None = None  # path or model name; default: the replicas' model
    session_header: str = "x-session-id"
    policy_cfg: PolicyConfig = field(default_factory=PolicyConfig)
    block_size: int = 16  # used for static replicas (Redis replicas announce theirs)
    refresh_interval: float = 1.0
    down_cooldown: float = 3.0
    connect_timeout: float = 2.0
    read_timeout: float = 600.0
    redis_timeout: float = 0.5
    max_body_bytes: int = 1 << 20  # 413 over it, before the body is read
    limits: RequestLimits = field(default_factory=RequestLimits)  # the replicas' caps, checked here


class RouterMetrics:
    """The router's own Prometheus registry (no process-global state)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.redis_up = Gauge("kvserve_router:redis_up", "1 when the prefix index is reachable",
                              registry=r)
        self.replicas_up = Gauge("kvserve_router:replicas_up", "Routable replicas", registry=r)
        self.requests = Counter("kvserve_router:requests", "Requests routed",
                                ["replica", "policy"], registry=r)
        self.matched_tokens = Histogram(
            "kvserve_router:predicted_matched_tokens", "Prompt tokens predicted to hit the cache "
            "of the chosen replica", registry=r,
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.prompt_tokens = Counter("kvserve_router:prompt_tokens",
                                     "Prompt tokens of routed requests", registry=r)
        self.decision_seconds = Histogram(
            "kvserve_router:routing_decision_seconds", "Time to choose a replica (tokenize, "
            "Redis lookup, score)", registry=r,
            buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0))
        self.redis_errors = Counter("kvserve_router:redis_errors", "Failed Redis calls",
                                    registry=r)
        self.retries = Counter("kvserve_router:retries", "Requests retried on another replica",
                               ["replica"], registry=r)
        self.upstream_errors = Counter("kvserve_router:upstream_errors",
                                       "Replica failures", ["replica", "stage"], registry=r)


@dataclass
class RouteInfo:
    decision: Decision
    prompt_tokens: int
    matched: dict[str, int]  # replica id -> predicted matched tokens


class Router:
    """Replica set, prefix lookup, policy and proxying; one per router process."""

    def __init__(self, cfg: RouterConfig) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {cfg.policy!r}; choose one of {POLICIES}")
        if not cfg.redis_url and not cfg.replicas:
            raise ValueError("the router needs replicas: pass --redis-url and/or --replicas")
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.index = PrefixIndex.from_url(cfg.redis_url, cfg.service_name, cfg.redis_timeout) \
            if cfg.redis_url else None
        self.redis_up = False
        self.known: dict[str, ReplicaInfo] = self._static()
        self.inflight: dict[str, int] = {}
        self.down_until: dict[str, float] = {}
        self.counter = 0
        self.tokenizer: Any = None
        self.http: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task] = []
        self._pending_refresh: asyncio.Task | None = None
        self._chat_encoder: Any = None

    def _static(self) -> dict[str, ReplicaInfo]:
        return {u: ReplicaInfo(u, u, "", self.cfg.block_size) for u in self.cfg.replicas}

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        timeout = httpx.Timeout(self.cfg.read_timeout, connect=self.cfg.connect_timeout)
        # Idle connections expire before uvicorn's 5 s keep-alive, so a request rarely races a
        # server-side close.
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
            max_connections=2048, max_keepalive_connections=256, keepalive_expiry=2.0))
        if self.index is not None:
            await self.refresh()
            self._tasks.append(asyncio.create_task(self._refresh_loop()))
        # Before serving when the model is already known, so the first requests are routed well.
        if self.cfg.policy == "prefix" and not await self._try_load_tokenizer():
            self._tasks.append(asyncio.create_task(self._load_tokenizer_loop()))
        self._update_gauges()

    async def close(self) -> None:
        for t in self._tasks + ([self._pending_refresh] if self._pending_refresh else []):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()
        if self.index is not None:
            await self.index.close()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_interval)
            await self.refresh()

    async def refresh(self) -> None:
        """Re-read the live replica set; this is also how the router notices Redis came back."""
        assert self.index is not None
        try:
            infos = await self.index.replicas()
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
            return
        self._redis_ok({i.replica_id: i for i in infos})

    def _redis_failed(self, exc: BaseException) -> None:
        self.metrics.redis_errors.inc()
        if self.redis_up:
            logger.warning("Redis unreachable (%s): routing by least load over %d known replicas",
                           exc, len(self.known))
        self.redis_up = False
        self._update_gauges()

    def _redis_ok(self, known: dict[str, ReplicaInfo]) -> None:
        if not self.redis_up:
            logger.info("Redis reachable: %d live replicas", len(known))
        self.redis_up = True
        # No heartbeat at all but static replicas configured: keep those rather than nothing.
        self.known = known or self._static()
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.redis_up.set(1 if self.redis_up else 0)
        self.metrics.replicas_up.set(len(self._routable(list(self.known.values()))))

    def _tokenizer_name(self) -> str | None:
        return self.cfg.tokenizer or next((i.model for i in self.known.values() if i.model), None)

    async def _try_load_tokenizer(self) -> bool:
        """Load the tokenizer (off the event loop); False when no name is known or it failed."""
        from kvserve.engine.tokenizer import load_tokenizer

        name = self._tokenizer_name()
        if not name:
            return False
        logger.info("loading the router's tokenizer from %s", name)
        try:
            self.tokenizer = await asyncio.to_thread(_load_tokenizer, name, load_tokenizer)
        except Exception as exc:  # a bad name must not kill the router: least-load still works
            logger.error("cannot load tokenizer %r (%s); pass --tokenizer. Prefix routing falls "
                         "back to least load until then", name, exc)
            return False
        return True

    async def _load_tokenizer_loop(self) -> None:
        """Retry until a replica announces its model (prefix routing needs the tokenizer)."""
        while not await self._try_load_tokenizer():
            if self.cfg.tokenizer:
                return  # an explicit name that failed will not get better
            await asyncio.sleep(self.cfg.refresh_interval)

    # ---- routing ------------------------------------------------------------------------------
    def _routable(self, infos: Sequence[ReplicaInfo]) -> list[ReplicaInfo]:
        now = time.monotonic()
        return [i for i in infos if self.down_until.get(i.replica_id, 0.0) <= now]

    def _is_down(self, replica_id: str) -> bool:
        return self.down_until.get(replica_id, 0.0) > time.monotonic()

    def mark_down(self, replica_id: str) -> None:
        self.down_until[replica_id] = time.monotonic() + self.cfg.down_cooldown
        self._update_gauges()

    def _candidate(self, info: ReplicaInfo, matched_blocks: int) -> Candidate:
        load = max(info.load, self.inflight.get(info.replica_id, 0))
        return Candidate(info.replica_id, info.url, load, info.kv_cache_usage, matched_blocks)

    async def _lookup(self, hashes: list[str]) -> list[ReplicaMatch]:
        """One Redis round trip when Redis is up; the last known set (no matches) otherwise.

        Redis answers only the matched block counts of the live replicas; their heartbeat fields
        (URL, load) come from the set `refresh` re-reads every second.
        """
        if self.index is not None and self.redis_up:
            try:
                counts = await self.index.match_counts(hashes)
            except (RedisError, OSError) as exc:
                self._redis_failed(exc)
            else:
                if not counts:  # no replica heartbeats: the static set, as `refresh` keeps it
                    return [ReplicaMatch(i, 0) for i in self.known.values()]
                if any(rid not in self.known for rid in counts) and self._pending_refresh is None:
                    self._pending_refresh = asyncio.create_task(self._refresh_now())
                return [ReplicaMatch(self.known[rid], n) for rid, n in counts.items()
                        if rid in self.known]
        return [ReplicaMatch(i, 0) for i in self.known.values()]

    async def _refresh_now(self) -> None:
        """A replica joined since the last refresh: learn its URL and load now."""
        try:
            await self.refresh()
        finally:
            self._pending_refresh = None

    async def route(self, path: str, body: dict[str, Any], headers: Any) -> RouteInfo:
        start = time.perf_counter()
        block_size = self._block_size()
        use_index = self.cfg.policy == "prefix" and self.index is not None and self.redis_up
        tokens = self._prompt_tokens(path, body) if use_index else None
        hashes: list[str] = []
        if tokens:
            from kvserve.engine.block_hash import block_hashes

            hashes = block_hashes(tokens, block_size, body.get("cache_salt"))
        # Only prefix routing needs Redis per request; the others use the set refreshed each second.
        matches = await self._lookup(hashes) if use_index else \
            [ReplicaMatch(i, 0) for i in self.known.values()]
        routable = self._routable([m.replica for m in matches]) or [m.replica for m in matches]
        by_id = {m.replica.replica_id: m.matched_blocks for m in matches}
        cands = [self._candidate(i, by_id.get(i.replica_id, 0)) for i in routable]
        policy = self.cfg.policy if (self.redis_up or self.cfg.policy != "prefix") else "least-load"
        session = headers.get(self.cfg.session_header) or body.get("user")
        self.counter += 1
        decision = decide(policy, cands, num_blocks=len(hashes), block_size=block_size,
                          cfg=self.cfg.policy_cfg, counter=self.counter, session_key=session)
        self.metrics.decision_seconds.observe(time.perf_counter() - start)
        return RouteInfo(decision, len(tokens or ()),
                         {rid: n * block_size for rid, n in by_id.items()})

    def _block_size(self) -> int:
        sizes = [i.block_size for i in self.known.values() if i.model]
        return max(set(sizes), key=sizes.count) if sizes else self.cfg.block_size

    def _prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids exactly as the engine computes them (None: cannot tell)."""
        if self.tokenizer is None:
            return None
        try:
            if self._chat_encoder is None or self._chat_encoder.tokenizer is not self.tokenizer:
                from kvserve.engine.tokenizer import ChatEncoder

                self._chat_encoder = ChatEncoder(self.tokenizer)
            return prompt_tokens_for(self.tokenizer, path, body, self._chat_encoder)
        except Exception as exc:  # a malformed body: the replica will answer with the 400
            logger.debug("cannot tokenize request for routing: %s", exc)
            return None

    def least_load_ranking(self) -> list[Candidate]:
        infos = self._routable(list(self.known.values())) or list(self.known.values())
        self.counter += 1
        return list(decide("least-load", [self._candidate(i, 0) for i in infos],
                           counter=self.counter).ranking)

    # ---- proxying -----------------------------------------------------------------------------
    async def proxy(self, method: str, path: str, query: str, body: bytes, headers: Any,
                    ranking: Sequence[Candidate], policy: str,
                    route: RouteInfo | None = None) -> Response:
        """Send to the first candidate that answers; retry the next one on failure before byte 1."""
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        for cand in ranking:
            opened = await self._open(cand, method, path, query, body, fwd)
            if opened is None and not self._is_down(cand.replica_id):
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
        self.inflight[cand.replica_id] = self.inflight.get(cand.replica_id, 0) + 1
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
            self._release(cand)
            if resp is not None:
                await resp.aclose()
            logger.warning("replica %s failed before answering (%s: %s); trying the next one",
                           cand.replica_id, type(exc).__name__, exc)
            self.metrics.upstream_errors.labels(cand.replica_id, "before_first_byte").inc()
            self.metrics.retries.labels(cand.replica_id).inc()
            if isinstance(exc, _DOWN_ERRORS) or resp is not None:
                # Refused, unreachable or answering 502/503/504. A dropped connection alone may be
                # a keep-alive race with a healthy replica: the next connect attempt will tell.
                self.mark_down(cand.replica_id)
            return None

    def _release(self, cand: Candidate) -> None:
        self.inflight[cand.replica_id] = max(0, self.inflight.get(cand.replica_id, 1) - 1)

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
            self.mark_down(cand.replica_id)
            if not sse:
                raise  # the client sees a broken response, never a silently short one
            yield sse_error(f"replica {cand.replica_id} failed mid-stream: {exc}")
        finally:
            self._release(cand)
            await resp.aclose()

    async def merged_models(self, headers: Any) -> dict[str, Any]:
        assert self.http is not None
        fwd = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        infos = self._routable(list(self.known.values()))
        answers = await asyncio.gather(
            *(self.http.get(i.url.rstrip("/") + "/v1/models", headers=fwd) for i in infos),
            return_exceptions=True)
        merged: dict[str, Any] = {}
        for ans in answers:
            if isinstance(ans, httpx.Response) and ans.status_code == 200:
                for model in ans.json().get("data", []):
                    merged.setdefault(model["id"], model)
        return {"object": "list", "data": list(merged.values())}


def _load_tokenizer(name: str, loader: Any) -> Any:
    from kvserve.engine.model_loader import resolve_model

    return loader(resolve_model(name))


def sse_error(message: str, code: int = 502) -> bytes:
    """An OpenAI-shaped error as one SSE event (the openai client raises APIError on it)."""
    err = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return f"data: {json.dumps(err)}\n\n".encode()


def _message_text(content: Any) -> Any:
    if isinstance(content, list):  # OpenAI content parts: the text parts, concatenated
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def prompt_tokens_for(tokenizer: Any, path: str, body: dict[str, Any],
                      chat_encoder: Any = None) -> list[int] | None:
    """Token ids of a chat or completion request body, via the engine's own tokenizer helpers
    (`chat_encoder`: an engine.tokenizer.ChatEncoder over the same tokenizer, for speed)."""
    from kvserve.engine.tokenizer import chat_token_ids, prompt_token_ids

    if path.endswith("/chat/completions"):
        messages = [{"role": m["role"], "content": _message_text(m.get("content")) or ""}
                    for m in body["messages"]]
        encode = chat_encoder or functools.partial(chat_token_ids, tokenizer)
        return encode(messages, add_generation_prompt=body.get("add_generation_prompt", True),
                      chat_template=body.get("chat_template"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return prompt_token_ids(tokenizer, prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    return None


def _error(status: int, message: str, kind: str = "service_unavailable") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                   "code": status}}, status_code=status)


def create_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    app.state.router = router
    _add_routes(app, router)
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)
    return app


def _add_routes(app: FastAPI, router: Router) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        up = router._routable(list(router.known.values()))
        body = {"status": "ok" if up else "no replicas", "redis_up": router.redis_up,
                "policy": router.cfg.policy,
                "replicas": [{"id": i.replica_id, "url": i.url, "load": i.load,
                              "inflight": router.inflight.get(i.replica_id, 0)} for i in up]}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        merged = await router.merged_models(request.headers)
        if not merged["data"]:
            return _error(503, "no replica answered /v1/models")
        return JSONResponse(merged)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        return await _forward(router, "/" + path, request)


_REQUEST_MODELS = {"/v1/completions": CompletionRequest,
                   "/v1/chat/completions": ChatCompletionRequest}


def validated_body(path: str, body: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The body of a routed request, checked as the replicas check it (the same pydantic models
    and caps); APIError (400) otherwise, so a hostile body never reaches the tokenizer."""
    try:
        data = parse_json_object(body, limits.max_json_depth)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), code="invalid_json") from exc
    try:
        _REQUEST_MODELS[path].model_validate(data).check(limits)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
    return data


async def _forward(router: Router, path: str, request: Request) -> Response:
    body = await request.body()
    route = None
    if request.method == "POST" and path in _ROUTED_PATHS:
        try:
            parsed = validated_body(path, body, router.cfg.limits)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        route = await router.route(path, parsed, request.headers)
    ranking = list(route.decision.ranking) if route else router.least_load_ranking()
    policy = route.decision.applied if route else "passthrough"
    if not ranking:
        return _error(503, "no replica is available; check that replicas heartbeat to Redis "
                           "(--redis-url, --service-name) or pass --replicas")
    try:
        return await router.proxy(request.method, path, request.url.query, body,
                                  request.headers, ranking, policy, route)
    except NoReplicaError as exc:
        return _error(503, str(exc))


# ---- CLI ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    pc = d.policy_cfg
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--redis-url", default=None,
                   help="Redis holding the prefix index and replica heartbeats")
    p.add_argument("--service-name", default=d.service_name,
                   help="index namespace (keys kvserve:<service>:...), as on the replicas")
    p.add_argument("--replicas", default="",
                   help="comma-separated replica URLs: the set without Redis, the fallback with it")
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="prefix: replica holding the longest prompt prefix, unless overloaded")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path or model name (default: the model the replicas announce)")
    p.add_argument("--session-header", default=d.session_header,
                   help="header hashed by the session policy (falls back to the body's `user`)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="block size of static replicas (Redis replicas announce theirs)")
    p.add_argument("--min-match-tokens", type=int, default=pc.min_match_tokens,
                   help="predicted cache hit needed before prefix beats least load")
    p.add_argument("--load-weight", type=float, default=pc.load_weight,
                   help="score = matched fraction - load_weight * load / max load")
    p.add_argument("--overload-factor", type=float, default=pc.overload_factor,
                   help="skip replicas with load > factor * mean + slack")
    p.add_argument("--overload-slack", type=int, default=pc.overload_slack)
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown,
                   help="seconds a replica that failed stays out of routing")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"))
    add_limit_args(p)


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    replicas = tuple(u.strip() for u in ns.replicas.split(",") if u.strip())
    pc = PolicyConfig(load_weight=ns.load_weight, overload_factor=ns.overload_factor,
                      overload_slack=ns.overload_slack, min_match_tokens=ns.min_match_tokens)
    return RouterConfig(host=ns.host, port=ns.port, redis_url=ns.redis_url,
                        service_name=ns.service_name, replicas=replicas, policy=ns.policy,
                        tokenizer=ns.tokenizer, session_header=ns.session_header.lower(),
                        policy_cfg=pc, block_size=ns.block_size, down_cooldown=ns.down_cooldown,
                        max_body_bytes=ns.max_body_bytes, limits=limits_from_args(ns))


def run_from_args(ns: argparse.Namespace) -> None:
    import uvicorn

    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request
    cfg = config_from_args(ns)
    if not cfg.redis_url and not cfg.replicas:
        raise SystemExit("kvserve router: pass --redis-url and/or --replicas url,url")
    logger.info("router on http://%s:%d policy=%s redis=%s static=%s", cfg.host, cfg.port,
                cfg.policy, cfg.redis_url, ",".join(cfg.replicas) or "-")
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=ns.log_level.lower(),
                access_log=False)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `kvserve router` to the CLI's subparsers; the handler is `args.func(args)`."""
    p = subparsers.add_parser(
        "router", help="prefix-aware router in front of kvserve replicas",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible router: sends each request to the replica that already "
                    "holds its prompt prefix (Redis index), unless that replica is overloaded.")
    add_arguments(p)
    p.set_defaults(func=run_from_args)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.service.router",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    main()
