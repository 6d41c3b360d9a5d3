"""One server, several models on one port (`kvserve serve MODEL --additional-model NAME=PATH`):
each model is the usual one-model app (service/server/app.py) around its own engine thread, all
engines seated on one shared KV pool (engine/multi_model.py); `ModelDispatch` sends each request
to the app of the model its JSON body's `model` names (none: the first model) and answers the
server-wide routes itself: /v1/models lists every model, /metrics merges every model's series
(label `model_name`), /health is every engine's.

`POST /v1/load_model` {"model_name", "model_path"} and `POST /v1/unload_model` {"model_name"}
change the set at runtime, only with KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING true (as the LoRA
endpoints' VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from kvserve.engine.errors import ConfigError, KVServeError
from kvserve.service.middleware import APIKeyMiddleware
from kvserve.service.openai_errors import APIError, error_body, install_error_handlers
from kvserve.service.response_models import ModelCard, ModelList
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.metrics import CONTENT_TYPE

logger = logging.getLogger("kvserve.service.api_server")
RUNTIME_ENV = ("KVSERVE_ALLOW_RUNTIME_MODEL_UPDATING",)
FRONT_PATHS = ("/v1/models", "/metrics", "/health", "/v1/load_model", "/v1/unload_model")


def runtime_updating_allowed() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes") for k in RUNTIME_ENV)


class ModelApps:
    """The model set (engines on one pool) and each model's app, entered and left at runtime."""

    def __init__(self, models: Any, make_app: Callable[[str, Any], FastAPI]) -> None:
        self.models = models  # engine/multi_model.ModelSet
        self.make_app = make_app
        self.apps: dict[str, FastAPI] = {}
        self._stacks: dict[str, contextlib.AsyncExitStack] = {}

    @property
    def first(self) -> str:
        return self.models.first

    async def start(self, name: str) -> None:
        """Build the model's app over its loaded engine and run its lifespan's start."""
        app = self.make_app(name, self.models.engines[name])
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(app.router.lifespan_context(app))
        self.apps[name], self._stacks[name] = app, stack

    async def stop(self, name: str) -> None:
        """Stop taking requests for the model, drain its engine, unload it from the pool."""
        self.apps.pop(name, None)
        stack = self._stacks.pop(name, None)
        if stack is not None:
            await stack.aclose()
        await asyncio.to_thread(self.models.remove, name)

    async def stop_all(self) -> None:
        for name in reversed(list(self._stacks)):
            self.apps.pop(name, None)
            await self._stacks.pop(name).aclose()

    def cards(self) -> list[ModelCard]:
        return [ModelCard(id=name, root=str(self.models.engines[name].config.model),
                          max_model_len=self.models.engines[name].max_model_len)
                for name in self.apps]

    def metrics_text(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Merged([a.state.metrics.registry for a in self.apps.values()]))
        return generate_latest(registry)


class _Merged:
    """A collector yielding every registry's families, one family per name (samples of the
    same series from several registries, e.g. a gauge without model_name, kept once)."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Any:
        fams: dict[str, Metric] = {}
        seen: set[tuple] = set()
        for reg in self.registries:
            for fam in reg.collect():
                out = fams.get(fam.name)
                if out is None:
                    out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for s in fam.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    if key not in seen:
                        seen.add(key)
                        out.samples.append(s)
        return iter(fams.values())


def build_front(apps: ModelApps, config: ServerConfig, engine_config: Any) -> FastAPI:
    """The server-wide routes over the model apps, and the lifespan that runs theirs."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        for name in list(apps.models.engines):
            await apps.start(name)
        try:
            yield
        finally:
            await apps.stop_all()

    front = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(front)

    @front.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=apps.cards()).model_dump())

    @front.get("/metrics")
    async def metrics() -> Response:
        return Response(apps.metrics_text(), media_type=CONTENT_TYPE)

    @front.get("/health")
    async def health() -> Response:
        for app in list(apps.apps.values()):
            engine = app.state.engine
            if engine.error is not None or engine.draining:
                return JSONResponse({"status": "unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok", "models": list(apps.apps)})

    if runtime_updating_allowed():
        _add_runtime_routes(front, apps, engine_config)
    if config.api_key:
        front.add_middleware(APIKeyMiddleware, api_key=config.api_key, public=config.public_paths)
    return front


def _add_runtime_routes(front: FastAPI, apps: ModelApps, engine_config: Any) -> None:
    @front.post("/v1/load_model")
    async def load_model(request: Request) -> Response:
        body = await _json(request)
        name, path = body.get("model_name"), body.get("model_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise APIError(400, "load_model takes {\"model_name\": ..., \"model_path\": ...}",
                           param="model_name")
        if name in apps.models.engines:
            raise APIError(400, f"model {name!r} is already served", param="model_name")
        config = dataclasses.replace(engine_config, model=path, served_model_name=name,
                                     tokenizer=None)
        try:
            await asyncio.to_thread(apps.models.add, name, config)
        except (KVServeError, OSError, ValueError) as exc:
            raise APIError(400, f"could not load {name!r} from {path!r}: {exc}",
                           param="model_path") from exc
        await apps.start(name)
        return Response(f"Success: model {name!r} added", media_type="text/plain")

    @front.post("/v1/unload_model")
    async def unload_model(request: Request) -> Response:
        name = (await _json(request)).get("model_name")
        if name not in apps.apps:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                           f"{list(apps.apps)}.", param="model_name", code="model_not_found")
        if name == apps.first:
            raise APIError(400, f"{name!r} sized the shared KV pool and stays; unload the "
                           "others", param="model_name")
        await apps.stop(name)
        return Response(f"Success: model {name!r} removed", media_type="text/plain")


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


class ModelDispatch:
    """The ASGI app of a several-model server: server-wide routes to `front`, a POST to the app
    of the model its body names (404 in OpenAI's shape for one not served), the rest to the
    first model's app."""

    def __init__(self, front: FastAPI, apps: ModelApps, max_body_bytes: int) -> None:
        self.front, self.apps, self.limit = front, apps, max_body_bytes
        self.state = front.state  # DrainingServer reads app.state (drain hooks)
        front.state.drain_hooks = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" or scope.get("path") in FRONT_PATHS:
            return await self.front(scope, receive, send)
        first = self.apps.apps.get(self.apps.first)
        if scope["type"] != "http" or scope["method"] != "POST":
            return await (first or self.front)(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                return await _send(send, 413, f"the body is over {self.limit} bytes")
        name = _model_field(body)
        app = first if name is None else self.apps.apps.get(name)
        if app is None:
            return await _send(send, 404, f"The model `{name}` does not exist; this server "
                               f"serves {list(self.apps.apps)}.", "model_not_found")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await app(scope, replay, send)


def _model_field(body: bytes) -> str | None:
    """The body's `model` (None when absent or not JSON: the first model's app answers)."""
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) and model else None


async def _send(send: Any, status: int, message: str, code: str | None = None) -> None:
    payload = json.dumps(error_body(status, message, param="model" if status == 404 else None,
                                    code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


class AllEngines:
    """Every model's engine as DrainingServer drains one: new requests 503, running ones get
    the grace period, together."""

    def __init__(self, apps: ModelApps) -> None:
        self.apps = apps

    async def shutdown(self, grace_period: float = 30.0) -> int:
        engines = [a.state.engine for a in list(self.apps.apps.values())]
        return sum(await asyncio.gather(*(e.shutdown(grace_period) for e in engines)))


def multi_model_app(engine_config: Any, config: ServerConfig) -> tuple[ModelDispatch, ModelApps]:
    """Load the models onto one shared pool and build the dispatching app. The engines step in
    threads of this process (the pool is this process's memory), whatever --engine-core says.
    The replica's heartbeat lists the additional models as held adapters, so a router sends
    their requests here (service/router/adapters.py) with the same block hashes."""
    from kvserve.engine.multi_model import ModelSet
    from kvserve.service.server.app import create_app
    from kvserve.service.server.publishing import make_publisher

    first = (config.served_model_names or [engine_config.served_model_name
                                           or engine_config.model])[0]
    configs = {first: dataclasses.replace(engine_config, served_model_name=first)}
    for name, path in config.additional_models:
        if name in configs:
            raise ConfigError(f"--additional-model {name}=...: the name {name!r} is taken")
        configs[name] = dataclasses.replace(engine_config, model=path, served_model_name=name,
                                            tokenizer=None)
    models = ModelSet(configs)
    apps: ModelApps

    def held() -> list[str]:
        return [n for n in apps.apps if n != first]

    publisher = make_publisher(config, first, engine_config.block_size, adapters=held)

    def make_app(name: str, engine: Any) -> FastAPI:
        own = dataclasses.replace(config, served_model_names=[name], additional_models=[],
                                  print_banner=config.print_banner and name == first)
        return create_app(engine, own, publisher if name == first else None)

    apps = ModelApps(models, make_app)
    return ModelDispatch(build_front(apps, config, engine_config), apps,
                         config.max_body_bytes), apps
