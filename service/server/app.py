"""The FastAPI app of one server: the OpenAI routes, /health, /metrics, /version, /tokenize, with
auth, the body limit and CORS; its lifespan starts the engine thread and drains it on shutdown."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import kvserve
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.errors import ConfigError, KVServeError, LoRANotFoundError
from kvserve.engine.sample.tokenizer import prompt_token_ids
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvserve.service.openai_errors import APIError, install_error_handlers
from kvserve.service.reasoning import reasoning_parser
from kvserve.service.request_models import CompletionRequest
from kvserve.service.request_validation import M, read_json_body, validate_request
from kvserve.service.responses_request import ResponsesRequest
from kvserve.service.response_models import (DetokenizeResponse, ModelCard, ModelList,
                                             TokenizeResponse)
from kvserve.service.server.banner import banner
from kvserve.service.server.chat import chat_prompt, create_chat_completion
from kvserve.service.server.chat_batch import BatchChatCompletionRequest, add_chat_batch_route
from kvserve.service.server.generate import add_generate_route
from kvserve.service.server.generate_models import GenerateRequest
from kvserve.service.server.completions import create_completion
from kvserve.service.server.responses import create_response
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.context import ServingContext
from kvserve.service.server.engine_streams import ClientDisconnected
from kvserve.service.server.lora_models import (LoadLoRAAdapterRequest, LoRAModels,
                                                UnloadLoRAAdapterRequest, not_found,
                                                runtime_updating_allowed)
from kvserve.service.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.service.server.openapi import install_openapi
from kvserve.service.server.prefix_cache import add_prefix_cache_route, dev_mode
from kvserve.service.server.publishing import PublisherObserver, stop_advertising
from kvserve.service.tokenize_request import DetokenizeRequest, TokenizeRequest

logger = logging.getLogger("kvserve.service.api_server")

# The JSON body each POST route reads (the handlers parse it themselves; see openapi.py).
REQUEST_BODIES: dict[str, Any] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    "/inference/v1/generate": GenerateRequest,
    "/v1/chat/completions/batch": BatchChatCompletionRequest}
LORA_BODIES: dict[str, Any] = {"/v1/load_lora_adapter": LoadLoRAAdapterRequest,
                               "/v1/unload_lora_adapter": UnloadLoRAAdapterRequest}


def create_app(llm_engine: Any, config: ServerConfig, publisher: Any = None) -> FastAPI:
    """Wire an engine into a server: metrics, the optional publisher, the AsyncEngine, the app.
    `llm_engine` is an LLMEngine (stepped in a thread here) or a CoreClient (an engine core
    process, engine/engine_core/). The AsyncEngine is `app.state.engine`."""
    from kvserve.engine.engine_core.core_client import CoreClient

    names = config.served_model_names or [llm_engine.model_name if not isinstance(
        llm_engine, CoreClient) else llm_engine.info.model_name]
    metrics = ServerMetrics(names[0])
    observers: list[Any] = [metrics]
    if publisher is not None:
        observers.append(PublisherObserver(publisher))
    from kvserve.engine.kv_events_zmq import make_kv_events_observer

    kv_events = make_kv_events_observer(llm_engine.config if not isinstance(
        llm_engine, CoreClient) else llm_engine.info.config)
    if kv_events is not None:  # vLLM-format KV events over ZMQ (--kv-events-config)
        observers.append(kv_events)
    tick = 1.0 if publisher is not None else None
    if isinstance(llm_engine, CoreClient):
        from kvserve.engine.engine_core.async_client import AsyncMPEngine

        engine: AsyncEngine = AsyncMPEngine(llm_engine, observers, idle_tick=tick)
    else:
        engine = AsyncEngine(llm_engine, observers, idle_tick=tick)
    return build_app(engine, config, metrics, publisher)


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: ServerMetrics,
              publisher: Any = None) -> FastAPI:
    """The FastAPI app of one server. Its lifespan starts the engine thread (and publisher) and
    drains the engine on shutdown."""
    names = config.served_model_names or [engine.model_name]
    ctx = ServingContext(
        engine=engine, served_model_names=names, tokenizer=copy.deepcopy(engine.tokenizer),
        max_waiting=config.waiting_limit(engine.config.max_num_seqs), limits=config.limits,
        request_timeout=config.request_timeout,
        trust_request_chat_template=config.trust_request_chat_template,
        chat_template_time_limit=config.chat_template_time_limit,
        prompt_tokens_details=config.enable_prompt_tokens_details,
        chat_template=config.chat_template, tool_parser=config.tool_call_parser,
        reasoning=reasoning_parser(config.reasoning_parser))
    if engine.config.enable_lora:
        ctx.loras = LoRAModels(engine, names)
    elif config.lora_modules:
        raise ConfigError("--lora-modules needs --enable-lora")
    metrics.set_cache_config(engine.memory_budget.block_size, engine.memory_budget.num_blocks)
    metrics.set_model_weight_bytes(
        engine.memory_budget.weight_bytes * engine.config.tensor_parallel_size)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        for module in config.lora_modules:  # a bad adapter stops the start, naming why
            await ctx.loras.load(module.name, module.path, module.base_model_name)
        if publisher is not None:
            await publisher.start()
        if config.print_banner:
            print(banner(config, names[0], engine.sampling_defaults), flush=True)
        try:
            yield
        finally:
            if publisher is not None:  # routers stop sending before the engine drains
                await stop_advertising(publisher)
            aborted = await engine.shutdown(config.shutdown_grace_period)
            if aborted:
                logger.warning("aborted %d request(s) at shutdown", aborted)
            for obs in engine.observers:  # the KV events publisher's sockets and thread
                getattr(obs, "close", lambda: None)()
            ctx.tokenizers.shutdown()

    app = FastAPI(title="kvserve", version=kvserve.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.ctx, app.state.metrics, app.state.config = ctx, metrics, config
    app.state.engine = engine
    # DrainingServer runs these as a SIGTERM drain starts, before waiting for running requests.
    app.state.drain_hooks = [] if publisher is None else [lambda: stop_advertising(publisher)]
    install_error_handlers(app)
    _add_routes(app, ctx, metrics)
    bodies = dict(REQUEST_BODIES)
    if ctx.loras is not None and runtime_updating_allowed():
        add_lora_routes(app, ctx)
        bodies.update(LORA_BODIES)
    if dev_mode():  # vLLM's VLLM_SERVER_DEV_MODE routes
        add_prefix_cache_route(app, ctx)
    install_openapi(app, bodies)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key,
                           public=config.public_paths)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


def openapi_document() -> dict[str, Any]:
    """The server's OpenAPI document from its routes alone, without a model or an engine (the
    docs site's HTTP reference; a live server serves the same at /openapi.json)."""
    app = FastAPI(title="kvserve", version=kvserve.__version__, docs_url=None, redoc_url=None)
    _add_routes(app, None, None)  # type: ignore[arg-type]  # handlers run only in a real app
    add_lora_routes(app, None)  # type: ignore[arg-type]
    install_openapi(app, {**REQUEST_BODIES, **LORA_BODIES})
    return app.openapi()


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics) -> None:
    add_generate_route(app, ctx)  # vLLM's token-level and batch routes, one module each
    add_chat_batch_route(app, ctx)
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, ctx)
        return await _disconnect_safe(create_completion(ctx, req, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, ctx)
        return await _disconnect_safe(create_chat_completion(ctx, req, request))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest, ctx)
        return await _disconnect_safe(create_response(ctx, req, request))

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=n, root=str(ctx.engine.config.model),
                           max_model_len=ctx.max_model_len) for n in ctx.served_model_names]
        loras = ctx.loras.requests.values() if ctx.loras is not None else []
        cards += [ModelCard(id=r.lora_name, root=r.lora_path, parent=ctx.model_name,
                            max_model_len=ctx.max_model_len) for r in loras]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/health")
    async def health() -> JSONResponse:
        reason = _dead_reason(ctx)
        if reason is not None:
            return JSONResponse({"status": "dead", "reason": reason}, status_code=503)
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
        req = await parse_body(request, TokenizeRequest, ctx)
        ctx.resolve_model(req.model)
        if req.messages is not None:
            chat = ChatCompletionRequest(
                messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                tools=req.tools)
            ids = await chat_prompt(ctx, chat)
        else:
            ids = await ctx.tokenizers.run(_tokenize, req.prompt or "", req.add_special_tokens)
        strs = ctx.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len,
                                             tokens=ids, token_strs=strs).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await parse_body(request, DetokenizeRequest, ctx)
        ctx.resolve_model(req.model)
        vocab = len(ctx.tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise APIError(400, f"tokens must be ids in [0, {vocab}), got {max(req.tokens)}",
                           param="tokens", code="invalid_value")
        return JSONResponse(DetokenizeResponse(prompt=await ctx.decode(req.tokens)).model_dump())


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    """vLLM's runtime adapter endpoints (only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """Load a PEFT LoRA adapter folder as model `lora_name` (only with
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and --enable-lora); 400 naming why it cannot be
        served."""
        req = await parse_body(request, LoadLoRAAdapterRequest, ctx)
        await ctx.loras.load(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """Unload adapter `lora_name`; 404 when it is not loaded."""
        req = await parse_body(request, UnloadLoRAAdapterRequest, ctx)
        try:
            await ctx.loras.unload(req.lora_name)
        except LoRANotFoundError as exc:
            raise not_found(exc) from None
        return PlainTextResponse(
            f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _tokenize(tokenizer: Any, prompt: str, add_special_tokens: bool) -> list[int]:
    if add_special_tokens:
        return prompt_token_ids(tokenizer, prompt)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _dead_reason(ctx: ServingContext) -> str | None:
    """Why the engine cannot serve (failed, stopped, a tensor-parallel worker or the engine
    core process gone, noticed even while no request runs), or None."""
    if ctx.engine.error is not None:
        return str(ctx.engine.error) or repr(ctx.engine.error)
    if not ctx.engine.is_running:
        return "the engine is not running"
    try:
        getattr(ctx.engine.engine, "check_health", lambda: None)()
    except KVServeError as exc:
        return str(exc)
    return None


async def _disconnect_safe(work: Any) -> Response:
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the engine requests are aborted



async def parse_body(request: Request, model: type[M], ctx: ServingContext) -> M:
    """The JSON body as `model`, checked against the server's limits; 400 in OpenAI's shape."""
    return validate_request(read_json_body(await request.body(), ctx.limits), model, ctx.limits)
