"""The router's FastAPI app: /health, /metrics, the merged /v1/models, and every other path
proxied; completions and chat completions are validated as the replicas would, then routed by
their prompt."""

from __future__ import annotations

from contextlib import asynccontextmanager
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
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.drain import DrainMiddleware, DrainState
from kvserve.service.router.proxy import ClientGoneError, ClientWatch, NoReplicaError, Proxy
from kvserve.service.router.routing import Router

_REQUEST_MODELS = {"/v1/completions": CompletionRequest,
                   "/v1/chat/completions": ChatCompletionRequest}


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
                "replicas": [{"id": i.replica_id, "url": i.url, "load": i.load,
                              "inflight": replicas.inflight.get(i.replica_id, 0)} for i in up]}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        merged = await proxy.merged_models(request.headers)
        if not merged["data"]:
            return _unavailable("no replica answered /v1/models")
        return JSONResponse(merged)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        return await _forward(router, proxy, "/" + path, request)


def validated_body(path: str, body: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The body of a routed request, checked as the replicas check it (the same pydantic models
    and caps); APIError (400) otherwise, so a hostile body never reaches the tokenizer."""
    data = read_json_body(body, limits)
    validate_request(data, _REQUEST_MODELS[path], limits)
    return data


async def _forward(router: Router, proxy: Proxy, path: str, request: Request) -> Response:
    body = await request.body()
    route = None
    if request.method == "POST" and path in _REQUEST_MODELS:
        try:
            parsed = validated_body(path, body, router.cfg.limits)
        except APIError as exc:
            return error_response(exc.status, exc.message, exc.param, exc.code)
        route = await router.route(path, parsed, request.headers)
    ranking = list(route.decision.ranking) if route else router.least_load_ranking()
    policy = route.decision.applied if route else "passthrough"
    if not ranking:
        return _unavailable("no replica is available; check that replicas heartbeat to Redis "
                            "(--redis-url, --service-name) or pass --replicas")
    watch = ClientWatch(request.receive)
    try:
        return await proxy.forward(request.method, path, request.url.query, body,
                                   request.headers, ranking, policy, route, watch)
    except NoReplicaError as exc:
        return _unavailable(str(exc))
    except ClientGoneError:
        router.metrics.client_disconnects.inc()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    finally:
        await watch.stop()


def _unavailable(message: str) -> JSONResponse:
    return error_response(503, message, code="service_unavailable", headers={"Retry-After": "1"})
