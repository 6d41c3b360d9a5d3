"""POST /v1/completions: prompts (text, texts, token ids) to choices, streamed as SSE or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.tokenizer import prompt_token_ids
from kvserve.service.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest,
                                      CompletionResponse, random_id)
from kvserve.service.serving_common import (SSE_DONE, Delta, RequestStream, ServingContext,
                                            StreamTracker, check_prompts, collect, max_tokens_for, merge_streams,
                                            sse, sse_error, start_requests, stop_hold, token_text,
                                            top_logprobs, unless_disconnected, usage_of)


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    ctx.admit()
    prompts = [p if isinstance(p, list) else prompt_token_ids(ctx.tokenizer, p)
               for p in req.prompts()]
    check_prompts(ctx, prompts, "prompt")
    params = [req.sampling_params(max_tokens_for(ctx, len(ids), req.max_tokens), req.logprobs,
                                  ctx.engine.sampling_defaults) for ids in prompts]
    request_id = random_id("cmpl")
    streams = await start_requests(ctx, request_id, prompts, params, priority=req.priority,
                                   cache_salt=req.cache_salt)
    if req.stream:
        body = _stream(ctx, req, request_id, model, streams, params[0], prompts)
        return StreamingResponse(body, media_type="text/event-stream")
    outputs = await unless_disconnected(raw, collect(streams))
    choices = [c for i, out in enumerate(outputs) for c in _choices(ctx, req, i, out, prompts[i])]
    response = CompletionResponse(id=request_id, model=model, usage=usage_of(outputs),
                                  choices=choices)
    return JSONResponse(response.model_dump())


def _choices(ctx: ServingContext, req: CompletionRequest, i: int, out: RequestOutput,
             prompt: list[int]) -> list[CompletionChoice]:
    echo = ctx.tokenizer.decode(prompt) if req.echo else ""
    return [CompletionChoice(
        index=i * req.n + c.index, text=echo + c.text, finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        logprobs=_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.logprobs, len(echo)))
        for c in sorted(out.outputs, key=lambda c: c.index)]


def _logprobs(tokenizer: Any, token_ids: Sequence[int], entries: list[dict[int, float]] | None,
              k: int | None, offset: int) -> CompletionLogProbs | None:
    """OpenAI's legacy logprobs object of a run of generated tokens."""
    if k is None or entries is None:
        return None
    lp = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(entry.get(tid))
        top: dict[str, float] = {}
        for token, value in top_logprobs(tokenizer, entry, k):
            top.setdefault(token, value)  # tokens that decode alike: keep the likelier
        lp.top_logprobs.append(top if k else None)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


async def _stream(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
                  streams: list[RequestStream], params: SamplingParams,
                  prompts: list[list[int]]) -> AsyncIterator[str]:
    tracker = StreamTracker(hold=stop_hold(params))
    latest: dict[int, RequestOutput] = {}
    echoed: set[int] = set()
    try:
        async for i, out in merge_streams(streams):
            latest[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                delta = tracker.delta(index, c)
                if delta is None:
                    continue
                prefix = ""
                if req.echo and index not in echoed:
                    prefix = ctx.tokenizer.decode(prompts[i])
                    echoed.add(index)
                yield sse(_chunk(ctx, req, request_id, model, index, delta, prefix, latest))
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield sse_error(exc)
        yield SSE_DONE
        return
    if req.include_usage:
        yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                     usage=usage_of(list(latest.values()))))
    yield SSE_DONE


def _chunk(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
           index: int, delta: Delta, prefix: str,
           latest: dict[int, RequestOutput]) -> CompletionResponse:
    choice = CompletionChoice(
        index=index, text=prefix + delta.text, finish_reason=delta.finish_reason,
        stop_reason=delta.stop_reason,
        logprobs=_logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, req.logprobs,
                           delta.offset))
    usage = None
    if req.stream_options and req.stream_options.continuous_usage_stats:
        usage = usage_of(list(latest.values()))
    return CompletionResponse(id=request_id, model=model, choices=[choice], usage=usage)
