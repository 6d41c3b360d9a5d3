"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of one AsyncEngine.

`python -m kvserve.service.api_server --model ...` takes the same flags as `kvserve serve`.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import kvserve
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.errors import KVServeError
from kvserve.engine.tokenizer import prompt_token_ids
from kvserve.service.errors import APIError, error_body, install_error_handlers
from kvserve.service.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.service.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      DetokenizeResponse, ModelCard, ModelList, RequestLimits,
                                      TokenizeRequest, TokenizeResponse)
from kvserve.service.serving_chat import chat_prompt, create_chat_completion
from kvserve.service.serving_common import ClientDisconnected, ServingContext, parse_body
from kvserve.service.serving_completion import create_completion

logger = logging.getLogger("kvserve.service.api_server")

DEFAULT_PUBLIC_PATHS = ("/health", "/metrics", "/version", "/ping")


@dataclass
class ServerConfig:
    """The HTTP side's settings (the engine's are in EngineConfig)."""

    host: str = "0.0.0.0"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)  # [] = the engine's model name
    api_key: str | None = None
    public_paths: tuple[str, ...] = DEFAULT_PUBLIC_PATHS  # open without the API key
    max_waiting: int | None = None
    max_body_bytes: int = 1 << 20
    limits: RequestLimits = field(default_factory=RequestLimits)
    allowed_origins: list[str] = field(default_factory=list)  # CORS off when empty
    shutdown_grace_period: float = 30.0
    log_level: str = "info"
    redis_url: str | None = None
    service_name: str = "default"
    advertise_url: str | None = None
    replica_id: str | None = None
    print_banner: bool = False  # print the curl line and Python snippet once started


# ---------------------------------------------------------------------------- ASGI middleware


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


# ---------------------------------------------------------------------------- the app


@dataclass
class PublisherObserver:
    """Feeds the Redis prefix-index publisher from the engine thread (events, load, snapshots)."""

    publisher: Any

    def request_added(self, request_id: str, arrival: float) -> None:
        pass

    def request_aborted(self, request_id: str) -> None:
        pass

    def after_step(self, outputs: list[Any], stats: Any, events: list[Any], engine: Any) -> None:
        snapshot = engine.cached_block_hashes() if self.publisher.wants_snapshot() else None
        self.publisher.on_step(events=events, stats=stats, snapshot=snapshot)


def create_app(llm_engine: Any, config: ServerConfig, publisher: Any = None) -> FastAPI:
    """Wire an LLMEngine into a server: metrics, the optional publisher, the AsyncEngine, the app.
    The AsyncEngine is `app.state.engine`."""
    names = config.served_model_names or [llm_engine.model_name]
    metrics = ServerMetrics(names[0])
    observers: list[Any] = [metrics]
    if publisher is not None:
        observers.append(PublisherObserver(publisher))
    engine = AsyncEngine(llm_engine, observers, idle_tick=1.0 if publisher is not None else None)
    return build_app(engine, config, metrics, publisher)


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics,
              publisher: Any = None) -> FastAPI:
    """The FastAPI app of one server. Its lifespan starts the engine thread (and publisher) and
    drains the engine on shutdown."""
    names = config.served_model_names or [engine.model_name]
    ctx = ServingContext(engine=engine, served_model_names=names,
                         tokenizer=copy.deepcopy(engine.tokenizer), max_waiting=config.max_waiting,
                         limits=config.limits)
    metrics.set_cache_config(engine.memory_budget.block_size, engine.memory_budget.num_blocks)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if publisher is not None:
            await publisher.start()
        if config.print_banner:
            print(banner(config, names[0], engine.sampling_defaults), flush=True)
        try:
            yield
        finally:
            aborted = await engine.shutdown(config.shutdown_grace_period)
            if aborted:
                logger.warning("aborted %d request(s) at shutdown", aborted)
            if publisher is not None:
                await publisher.close()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.ctx, app.state.metrics, app.state.config = ctx, metrics, config
    app.state.engine = engine
    install_error_handlers(app)
    _add_routes(app, ctx, metrics)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           public=config.public_paths)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, ctx.limits)
        return await _disconnect_safe(create_completion(ctx, req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, ctx.limits)
        return await _disconnect_safe(create_chat_completion(ctx, req, request))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=n, root=str(ctx.engine.config.model),
                           max_model_len=ctx.max_model_len) for n in ctx.served_model_names]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        if ctx.engine.error is not None or (not ctx.engine.is_running) or _workers_dead(ctx):
            return JSONResponse({"status": "dead"}, status_code=503)
        if ctx.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ping")
    async def ping() -> JSONResponse:
        return await health()

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kvserve.__version__})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, TokenizeRequest, ctx.limits)
        ctx.resolve_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(messages=req.messages,
                                         add_generation_prompt=req.add_generation_prompt)
            ids = chat_prompt(ctx, chat)
        elif req.add_special_tokens:
            ids = prompt_token_ids(ctx.tokenizer, req.prompt or "")
        else:
            ids = list(ctx.tokenizer(req.prompt or "", add_special_tokens=False)["input_ids"])
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len,
                                             tokens=ids).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest, ctx.limits)
        ctx.resolve_model(req.model)
        vocab = len(ctx.tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab}), got {max(req.tokens)}",
                           param="tokens", code="invalid_value")
        return JSONResponse(DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))
                            .model_dump())


def _workers_dead(ctx: ServingContext) -> bool:
    """A tensor-parallel worker died (noticed even while no request runs)."""
    try:
        getattr(ctx.engine.engine, "check_health", lambda: None)()
    except KVServeError:
        return True
    return False


async def _disconnect_safe(work: Any) -> Response:
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the engine requests are aborted


# ---------------------------------------------------------------------------- running it


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, first drains the engine (new requests get 503, running
    ones finish within the grace period), then stops. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._drain_requested = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
        elif self._drain_requested:  # a second signal: stop now
            logger.warning("second signal: exiting without waiting for running requests")
            self.should_exit = self.force_exit = True
        else:
            self._drain_requested = True
            logger.info("signal %s: draining (grace period %.0f s)", signal.Signals(sig).name,
                        self.grace)
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        aborted = await self.engine.shutdown(self.grace)
        logger.info("drained (%d request(s) aborted); stopping", aborted)
        self.should_exit = True


class ServerThread:
    """A DrainingServer on a background thread (tests, benchmarks, notebooks).

    `stop()` drains like SIGTERM would; `drain()` starts that without waiting."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning") -> None:
        config: ServerConfig = app.state.config
        uv = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=max(int(config.shutdown_grace_period), 1))
        self.server = DrainingServer(uv, app.state.engine, config.shutdown_grace_period)
        self.thread = threading.Thread(target=self.server.run, name="kvserve-http", daemon=True)
        self.host = host

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def drain(self) -> None:
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self, timeout: float = 60.0) -> None:
        if self.thread.is_alive():
            self.drain()
            self.thread.join(timeout)


def banner(config: ServerConfig, model: str, defaults: dict[str, Any] | None = None) -> str:
    """How to call this server: a curl line and the Python snippet (and the default sampling
    from the model's generation config, when it sets any)."""
    host = "localhost" if config.host in ("0.0.0.0", "::", "") else config.host
    base = f"http://{host}:{config.port}"
    auth = f" -H 'Authorization: Bearer $KVSERVE_API_KEY'" if config.api_key else ""
    body = json.dumps({"model": model, "messages": [
        {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32})
    return "\n".join([
        f"kvserve is serving {model!r} at {base}/v1  (metrics: {base}/metrics)",
        *([f"default sampling (generation_config.json; a request's own values win): " +
           ", ".join(f"{k} {v}" for k, v in defaults.items())] if defaults else []),
        "",
        "Try it:",
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
        "",
        "  import openai",
        f"  client = openai.Client(base_url=\"{base}/v1\", api_key=\"dummy\")",
        "  response = client.chat.completions.create(",
        f"      model=\"{model}\",",
        "      messages=[{\"role\": \"user\", \"content\": \"Explain how the KV cache works\"}],",
        "      temperature=0.7, max_tokens=512, stream=True,",
        "  )",
        "  for chunk in response:",
        "      if chunk.choices[0].delta.content:",
        "          print(chunk.choices[0].delta.content, end=\"\")",
        "",
    ])


def make_publisher(config: ServerConfig, model: str, block_size: int) -> Any:
    """The Redis prefix-index publisher when --redis-url is set (None otherwise)."""
    if not config.redis_url:
        return None
    try:
        from kvserve.service.prefix_index import PrefixIndexPublisher
    except ModuleNotFoundError as exc:
        if exc.name != "kvserve.service.prefix_index":
            raise
        logger.warning("--redis-url given but kvserve.service.prefix_index is not installed; "
                       "not publishing block hashes")
        return None
    host = socket.gethostname()
    return PrefixIndexPublisher(
        redis_url=config.redis_url, service=config.service_name,
        replica_id=config.replica_id or f"{host}-{config.port}",
        url=config.advertise_url or f"http://{host}:{config.port}", model=model,
        block_size=block_size)


def run_server(engine_config: Any, config: ServerConfig) -> int:
    """Load the model, print the memory budget, serve until SIGTERM/SIGINT (then drain)."""
    from kvserve.engine.llm_engine import LLMEngine

    llm_engine = LLMEngine.from_config(engine_config)
    logger.info("memory budget: %s", llm_engine.memory_budget.describe())
    model = (config.served_model_names or [llm_engine.model_name])[0]
    publisher = make_publisher(config, model, llm_engine.block_size)
    app = create_app(llm_engine, config, publisher)
    uv_config = uvicorn.Config(app, host=config.host, port=config.port,
                               log_level=config.log_level.lower(),
                               timeout_graceful_shutdown=max(int(config.shutdown_grace_period), 1))
    server = DrainingServer(uv_config, app.state.engine, config.shutdown_grace_period)
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", config.host, config.port)
    try:
        server.run()
    finally:
        llm_engine.shutdown()  # tensor-parallel workers go with the server
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvserve.service.api_server`: the flags of `kvserve serve`."""
    from kvserve.service import cli

    parser = cli.build_serve_parser(prog="python -m kvserve.service.api_server")
    return cli.run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
