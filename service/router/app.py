"""The router's FastAPI app: /health, /metrics, the merged /v1/models (with the registered LoRA
adapters), and every other path proxied; completions, chat completions and Responses are
validated as the replicas would, then routed by their prompt (a Responses request's as its chat
completion's) and adapter (loaded on a replica first if needed)."""

from __future__ import annotations

from contextlib import asynccontextmanager
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvserve.service.limits import RequestLimits
from kvserve.service.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvserve.service.openai_errors import APIError, error_response
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.request_models import CompletionRequest
from kvserve.service.request_validation import read_json_body, validate_request
from kvserve.service.responses_request import ResponsesRequest
from kvserve.service.router import pd
from kvserve.service.router.adapters import AdapterLoadError
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.drain import DrainMiddleware, DrainState
from kvserve.service.router.migration import Migrator, migratable, upstream_form
from kvserve.service.router.proxy import (ClientGoneError, ClientWatch, NoReplicaError, Proxy,
                                          forward_headers)
from kvserve.service.router.routing import RouteInfo, Router
from kvserve.service.routing_policy import Candidate

logger = logging.getLogger("kvserve.router")
_REQUEST_MODELS = {"/v1/completions": CompletionRequest,
                   "/v1/chat/completions": ChatCompletionRequest,
                   "/v1/responses": ResponsesRequest}


def create_app(cfg: RouterConfig) -> FastAPI:
    router = Router(cfg)
    drain = DrainState()
    proxy = Proxy(cfg, router.replicas, router.metrics, drain)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.start()
        await router.start()
        yield
        await router.close()
        await proxy.close()

    app = FastAPI(title="kvserve router", lifespan=lifespan)
    router.metrics.draining.set_function(lambda: float(drain.draining))
    app.state.router, app.state.proxy, app.state.drain, app.state.config = \
        router, proxy, drain, cfg
    app.state.migrator = Migrator(cfg, router, proxy)
    _add_routes(app, router, proxy)
    # Outermost last: drain (503), then auth (401, before any body is read), then the body cap.
    app.add_middleware(BodyLimitMiddleware, limit=cfg.max_body_bytes)
    if cfg.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=cfg.api_key, public=cfg.public_paths)
    app.add_middleware(DrainMiddleware, state=drain)
    return app


def _add_routes(app: FastAPI, router: Router, proxy: Proxy) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        replicas = router.replicas
        up = replicas.routable()
        body = {"status": "ok" if up else "no replicas", "redis_up": replicas.redis_up,
                "policy": router.cfg.policy,
                "replicas": [{"id": i.replica_id, "url": i.url, "load": i.load, "role": i.role,
                              "inflight": replicas.inflight.get(i.replica_id, 0),
                              "adapters": sorted(i.adapters)} for i in up]}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        merged = await proxy.merged_models(request.headers)
        if not merged["data"]:
            return _unavailable("no replica answered /v1/models")
        _add_registered_adapters(merged, router)
        return JSONResponse(merged)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        return await _forward(router, proxy, "/" + path, request, app.state.migrator)


def validated_body(path: str, body: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The body of a routed request, checked as the replicas check it (the same pydantic models
    and caps); APIError (400) otherwise, so a hostile body never reaches the tokenizer."""
    data = read_json_body(body, limits)
    validate_request(data, _REQUEST_MODELS[path], limits)
    return data


async def _forward(router: Router, proxy: Proxy, path: str, request: Request,
                   migrator: Migrator) -> Response:
    body = await request.body()
    route, parsed = None, None
    if request.method == "POST" and path in _REQUEST_MODELS:
        try:
            parsed = validated_body(path, body, router.cfg.limits)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        route = await router.route(*upstream_form(path, parsed), request.headers)
    ranking = list(route.decision.ranking) if route else router.least_load_ranking()
    policy = route.decision.applied if route else "passthrough"
    if not ranking:
        return _unavailable("no replica is available; check that replicas heartbeat to Redis "
                            "(--redis-url, --service-name) or pass --replicas")
    on_missing = None
    if route is not None and route.adapter is not None:
        try:
            ranking = await _adapter_ranking(router, route, ranking, request.headers)
        except AdapterLoadError as exc:
            return _unavailable(str(exc))
        if router.adapters.registered(route.adapter):
            on_missing = _reloader(router, route.adapter, request.headers)
    if route is not None and route.pd_plan is not None and parsed is not None:
        parsed, body = await _pd_prefill(router, proxy, path, parsed, body, request.headers,
                                         route)
    watch = ClientWatch(request.receive)
    try:
        if parsed is not None and on_missing is None and migratable(router.cfg, path, parsed):
            # a stream the router can move to another replica if its replica fails
            return await migrator.forward(path, request.url.query, parsed, request.headers,
                                          ranking, policy, route, watch)
        return await proxy.forward(request.method, path, request.url.query, body,
                                   request.headers, ranking, policy, route, watch, on_missing)
    except NoReplicaError as exc:
        return _unavailable(str(exc))
    except ClientGoneError:
        router.metrics.client_disconnects.inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    finally:
        await watch.stop()


async def _pd_prefill(router: Router, proxy: Proxy, path: str, parsed: dict[str, Any],
                      body: bytes, headers: Any, route: RouteInfo
                      ) -> tuple[dict[str, Any], bytes]:
    """--policy pd: the prompt prefilled on a prefill replica when the plan says so, and the
    decode request's body with its kv_transfer_params; the request unchanged otherwise (the
    decode replica prefills locally). A client's own kv_transfer_params (a P/D sidecar in
    front) are left alone."""
    plan = route.pd_plan
    assert plan is not None
    if "kv_transfer_params" in parsed or path not in pd.PATHS:
        return parsed, body  # a /v1/responses request: its replica prefills it
    decision = pd.LOCAL_ADAPTER if route.adapter is not None and plan.remote else plan.decision
    if decision == pd.REMOTE:
        assert proxy.http is not None
        start = time.perf_counter()
        got = await pd.remote_prefill(proxy.http, path, parsed, forward_headers(headers),
                                      plan.prefill, router.cfg.pd, router.replicas.acquire,
                                      router.replicas.release, router.replicas.mark_down,
                                      router.not_a_producer)
        router.metrics.pd_prefill_seconds.observe(time.perf_counter() - start)
        if got is None:
            decision = pd.FALLBACK
        else:
            parsed = {**parsed, "kv_transfer_params": got[0]}
            body = json.dumps(parsed).encode()
            route.pd_prefilled_by = got[1]
    route.pd_decision = decision
    router.metrics.pd_decisions.labels(decision).inc()
    return parsed, body


async def _adapter_ranking(router: Router, route: RouteInfo, ranking: list[Candidate],
                           headers: Any) -> list[Candidate]:
    """The ranking of an adapter request, after the adapter was loaded where the route says
    (or where a load already in flight puts it: concurrent requests share one load)."""
    adapter = route.adapter
    assert adapter is not None
    if route.load_on is None:
        outcome = "resident" if route.resident else "unknown"
    else:
        rid = await router.adapters.ensure(adapter, route.load_on, headers)
        ranking = sorted(ranking, key=lambda c: c.replica_id != rid)  # stable: rid first
        outcome = "loaded"
    router.metrics.adapter_requests.labels(router.adapters.label(adapter), outcome).inc()
    return ranking


def _reloader(router: Router, adapter: str, headers: Any
              ) -> Callable[[Candidate], Awaitable[bool]]:
    """The proxy's hook for a replica that answers 404 to a registered adapter (it evicted it
    since its last heartbeat): load it there again; False when that fails (try the next)."""
    async def reload(cand: Candidate) -> bool:
        try:
            await router.adapters.ensure(adapter, cand, headers, join=False)
        except AdapterLoadError as exc:
            logger.warning("%s; trying the next replica", exc)
            return False
        return True
    return reload


def _add_registered_adapters(merged: dict[str, Any], router: Router) -> None:
    """Registered adapters no replica lists yet, as vLLM lists an adapter (with its parent)."""
    ids = {m.get("id") for m in merged["data"]}
    base = router.replicas.announced_model() or next(
        (m["id"] for m in merged["data"] if not m.get("parent")), None)
    for name, path in router.adapters.paths.items():
        if name not in ids:
            merged["data"].append({"id": name, "object": "model", "created": int(time.time()),
                                   "owned_by": "kvserve", "root": path, "parent": base})


def _unavailable(message: str) -> JSONResponse:
    return error_response(503, message, code="service_unavailable", headers={"Retry-After": "1"})
