"""POST /v1/chat/completions: messages through the chat template, answered whole or as SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.tokenizer import chat_token_ids
from kvserve.service.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatLogProbs, ChatResponseMessage,
                                      ChatStreamChoice, ChatTokenLogprob, DeltaMessage, TopLogprob,
                                      random_id)
from kvserve.service.serving_common import (SSE_DONE, Delta, RequestStream, ServingContext, StreamTracker,
                                            check_prompts, collect, max_tokens_for, merge_streams, sse, sse_error,
                                            start_requests, stop_hold, token_text, top_logprobs,
                                            unless_disconnected, usage_of)
from kvserve.service.tool_calls import (ToolCallStream, ToolPlan, finish_reason, parse_output,
                                        template_messages)


def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    template = req.chat_template or getattr(ctx.tokenizer, "chat_template", None) or ""
    messages, tools = template_messages([m.as_template_input() for m in req.messages],
                                        req.tool_plan(), template)
    return chat_token_ids(ctx.tokenizer, messages, req.add_generation_prompt, req.chat_template,
                          tools)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    ctx.admit()
    prompt = chat_prompt(ctx, req)
    check_prompts(ctx, [prompt], "messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(ctx, len(prompt), req.requested_max_tokens, param, "messages")
    params = req.sampling_params(max_tokens, req.num_logprobs, ctx.engine.sampling_defaults)
    request_id = random_id("chatcmpl")
    streams = await start_requests(ctx, request_id, [prompt], [params], priority=req.priority,
                                   cache_salt=req.cache_salt)
    if req.stream:
        body = _stream(ctx, req, request_id, model, streams, stop_hold(params))
        return StreamingResponse(body, media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, collect(streams))
    plan = req.tool_plan()
    choices = [ChatChoice(
        index=c.index, message=_message(plan, c.text),
        finish_reason=_finish_reason(plan, c.text, c.finish_reason), stop_reason=c.stop_reason,
        logprobs=_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0))
        for c in sorted(out.outputs, key=lambda c: c.index)]
    if not req.logprobs:
        for choice in choices:
            choice.logprobs = None
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage_of([out]))
    return JSONResponse(response.model_dump())


def _message(plan: ToolPlan | None, text: str) -> ChatResponseMessage:
    if plan is None:
        return ChatResponseMessage(content=text)
    content, calls = parse_output(plan, text)
    return ChatResponseMessage(content=content, tool_calls=calls or None)


def _finish_reason(plan: ToolPlan | None, text: str, reason: str | None) -> str | None:
    return reason if plan is None else finish_reason(parse_output(plan, text)[1], reason)


def _logprobs(tokenizer: Any, token_ids: Sequence[int], entries: list[dict[int, float]] | None,
              k: int) -> ChatLogProbs | None:
    if entries is None:
        return None
    content = []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        content.append(ChatTokenLogprob(
            token=text, logprob=entry.get(tid, float("-inf")), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                          for t, lp in top_logprobs(tokenizer, entry, k)]))
    return ChatLogProbs(content=content)


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, model: str,
                  streams: list[RequestStream], hold: int) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: Any = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    for i in range(req.n):  # the role first, as OpenAI does
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    tracker = StreamTracker(hold=hold)
    plan = req.tool_plan()
    tools = {i: ToolCallStream(plan) for i in range(req.n)} if plan is not None else {}
    last: RequestOutput | None = None
    try:
        async for _, out in merge_streams(streams):
            last = out
            for c in out.outputs:
                delta = tracker.delta(c.index, c)
                if delta is None:
                    continue
                lp = _logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs,
                               req.top_logprobs or 0) if req.logprobs else None
                usage = usage_of([out]) if continuous else None
                if c.index in tools:
                    for piece in _tool_chunks(c.index, tools[c.index], delta, lp):
                        yield chunk([piece], usage)
                    continue
                choice = ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=delta.text), logprobs=lp,
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
                yield chunk([choice], usage)
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield sse_error(exc)
        yield SSE_DONE
        return
    if req.include_usage and last is not None:
        yield chunk([], usage_of([last]))
    yield SSE_DONE


def _tool_chunks(index: int, stream: ToolCallStream, delta: Delta, lp: ChatLogProbs | None
                 ) -> list[ChatStreamChoice]:
    """A tool-calling choice's chunks for one delta: text or call fragments as they become
    safe to send, then (at the end) the calls and finish_reason "tool_calls"."""
    fields = [f for f in [stream.feed(delta.text)] if f]
    if delta.finish_reason is not None:
        fields += stream.finish()
    pieces = [ChatStreamChoice(index=index, delta=DeltaMessage(**f), logprobs=lp if i == 0 else None)
              for i, f in enumerate(fields)]
    if delta.finish_reason is not None:
        pieces.append(ChatStreamChoice(
            index=index, delta=DeltaMessage(),
            finish_reason=finish_reason(stream.calls, delta.finish_reason),
            stop_reason=delta.stop_reason))
    return pieces
