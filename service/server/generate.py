"""POST /inference/v1/generate: vLLM's tokens-in, tokens-out endpoint. Token ids and sampling
params in; token ids, logprobs and finish reasons out, whole or as SSE, in vLLM's shapes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import RequestStream
from kvserve.engine.outputs import Logprob
from kvserve.service.response_models import (ChatLogProbs, ChatTokenLogprob, TopLogprob,
                                             UsageInfo, random_id)
from kvserve.service.request_validation import read_json_body, validate_request
from kvserve.service.server.context import ServingContext
from kvserve.service.server.engine_streams import (before, collect, stream_failure,
                                                   ClientDisconnected, merge_streams,
                                                   start_requests, unless_disconnected, until)
from kvserve.service.server.generate_models import (GenerateRequest, GenerateResponse,
                                                    GenerateResponseChoice,
                                                    GenerateResponseStreamChoice,
                                                    GenerateStreamResponse)
from kvserve.service.server.logprobs import MIN_LOGPROB, prompt_logprobs_json
from kvserve.service.server.usage import usage_of
from kvserve.service.sse import SSE_DONE

REQUEST_ID_HEADER = "x-request-id"  # vLLM's: it names the request instead of the body's id


def add_generate_route(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/inference/v1/generate")
    async def generate(request: Request) -> Response:
        """vLLM's tokens-in, tokens-out generation (its GenerateRequest body)."""
        limits = ctx.limits
        req = validate_request(read_json_body(await request.body(), limits), GenerateRequest,
                               limits)
        return await disconnect_safe(create_generate(ctx, req, request))


async def create_generate(ctx: ServingContext, req: GenerateRequest, raw: Request) -> Response:
    ctx.resolve_model(req.model)
    deadline = ctx.deadline(raw, asyncio.get_running_loop().time())
    sp = req.sampling_params
    with ctx.admitted():
        ctx.check_prompts([req.token_ids], "token_ids")
        max_tokens = ctx.max_tokens_for(len(req.token_ids), sp.max_tokens,
                                        "sampling_params.max_tokens", "token_ids")
        params = sp.sampling_params(max_tokens, sp.logprobs)
    response_id = f"generate-tokens-{raw.headers.get(REQUEST_ID_HEADER) or req.request_id}"
    # the engine's own id stays unique even when two clients send the same request_id
    streams = await before(deadline, start_requests(
        ctx, random_id("generate"), [list(req.token_ids)], [params], priority=req.priority,
        cache_salt=req.cache_salt, lora_request=ctx.lora_request(req.model)))
    if req.stream:
        body = _stream(ctx, req, response_id, streams, deadline)
        return StreamingResponse(body, media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, collect(streams, deadline))
    choices = [GenerateResponseChoice(
        index=c.index, finish_reason=c.finish_reason or "stop", token_ids=list(c.token_ids),
        logprobs=token_logprobs(c.token_ids, c.logprobs, sp.logprobs))
        for c in sorted(out.outputs, key=lambda c: c.index)]
    response = GenerateResponse(request_id=response_id, choices=choices,
                                prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs))
    return JSONResponse(response.model_dump())


def token_logprobs(token_ids: Sequence[int], entries: list[dict[int, Logprob]] | None,
                   k: int | None) -> ChatLogProbs | None:
    """vLLM's token-id logprobs: each token named `token_id:<id>`, no bytes; `top_logprobs` holds
    max(k, 1) entries, the sampled token first (vLLM's order), then the likeliest others."""
    if k is None or entries is None:
        return None
    content = []
    for tid, entry in zip(token_ids, entries):
        own = entry.get(tid)
        if own is None:
            content.append(ChatTokenLogprob(token=f"token_id:{tid}", logprob=MIN_LOGPROB))
            continue
        others = sorted(((t, lp) for t, lp in entry.items() if t != tid),
                        key=lambda kv: kv[1].logprob, reverse=True)
        top = [(tid, own), *others][:max(k, 1)]
        content.append(ChatTokenLogprob(
            token=f"token_id:{tid}", logprob=max(own.logprob, MIN_LOGPROB),
            top_logprobs=[TopLogprob(token=f"token_id:{t}", logprob=max(lp.logprob, MIN_LOGPROB))
                          for t, lp in top]))
    return ChatLogProbs(content=content)


async def _stream(ctx: ServingContext, req: GenerateRequest, response_id: str,
                  streams: list[RequestStream], deadline: float | None) -> AsyncIterator[str]:
    """vLLM's SSE events: one chunk per choice with new tokens (its finish reason on the last),
    a usage chunk with stream_options.include_usage, then [DONE]."""
    sent: dict[int, int] = {}  # choice index -> tokens already streamed
    k = req.sampling_params.logprobs
    last = None
    try:
        async for _, out in until(deadline, merge_streams(streams)):
            last = out
            events = []
            for c in out.outputs:
                start = sent.get(c.index, 0)
                if len(c.token_ids) == start:
                    continue
                sent[c.index] = len(c.token_ids)
                new = list(c.token_ids[start:])
                lps = c.logprobs[start:] if c.logprobs is not None else None
                chunk = GenerateStreamResponse(request_id=response_id, choices=[
                    GenerateResponseStreamChoice(
                        index=c.index, finish_reason=c.finish_reason, token_ids=new,
                        logprobs=token_logprobs(new, lps, k))])
                if req.continuous_usage:  # this choice's tokens so far, as vLLM counts
                    chunk.usage = UsageInfo.of(len(out.prompt_token_ids), len(c.token_ids), 0)
                    chunk.usage.prompt_tokens_details = None
                events.append(f"data: {chunk.model_dump_json()}\n\n")
            if events:
                yield "".join(events)
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield stream_failure(exc)
        return
    tail = ""
    if req.include_usage and last is not None:
        final = GenerateStreamResponse(request_id=response_id, choices=[],
                                       usage=usage_of([last], ctx.prompt_tokens_details))
        tail = f"data: {final.model_dump_json(exclude_none=True)}\n\n"
    yield tail + SSE_DONE


async def disconnect_safe(work: Awaitable[Response]) -> Response:
    """`work`'s response; 499 when the client left (its engine requests are aborted)."""
    try:
        return await work
    except ClientDisconnected:
        return Response(status_code=499)
