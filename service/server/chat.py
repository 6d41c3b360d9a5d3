"""POST /v1/chat/completions: messages through the chat template, answered whole or as SSE."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import RequestStream
from kvserve.engine.outputs import Logprob, RequestOutput
from kvserve.service.chat_request import ChatCompletionRequest
from kvserve.service.response_models import (ChatChoice, ChatCompletionResponse, ChatLogProbs,
                                             ChatResponseMessage, ChatStreamChoice,
                                             ChatTokenLogprob, DeltaMessage, TopLogprob, random_id)
from kvserve.service.server.chat_reasoning import (Splitters, reasoning_splitters, split_delta,
                                                   split_whole)
from kvserve.service.server.chunk_json import ChunkFramer, chat_choice
from kvserve.service.server.context import ServingContext
from kvserve.service.server.engine_streams import (before, collect, stream_failure,
                                                   merge_streams, start_requests,
                                                   unless_disconnected, until)
from kvserve.service.server.logprobs import (logprob_of, prompt_logprobs_json, token_text,
                                             top_logprobs)
from kvserve.service.server.stream_deltas import Delta, StreamTracker, stop_hold
from kvserve.service.server.token_ids import event_with, with_fields
from kvserve.service.server.usage import usage_of, usage_text
from kvserve.service.sse import SSE_DONE
from kvserve.service.tool_calls import (ToolCallStream, ToolPlan, finish_reason, parse_output,
                                        template_messages)


async def chat_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    req.use_tool_parser(ctx.tool_parser)
    template = req.chat_template or ctx.chat_template \
        or getattr(ctx.tokenizer, "chat_template", None) or ""
    messages, tools = template_messages([m.as_template_input() for m in req.messages],
                                        req.tool_plan(), template, ctx.tool_parser)
    kwargs = dict(req.chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    return await ctx.chat_token_ids(messages, req.add_generation_prompt, req.chat_template,
                                    kwargs or None)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    deadline = ctx.deadline(raw, asyncio.get_running_loop().time())
    with ctx.admitted():
        prompt = await before(deadline, chat_prompt(ctx, req))
        ctx.check_prompts([prompt], "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = ctx.max_tokens_for(len(prompt), req.requested_max_tokens, param, "messages")
        params = req.sampling_params(max_tokens, req.num_logprobs, ctx.engine.sampling_defaults)
        plan = req.tool_plan()
        if plan is not None and plan.mode == "auto" and plan.format.needs_special_tokens:
            params.skip_special_tokens = False  # the parser's opener is a special token
        split = reasoning_splitters(ctx.reasoning, ctx.tokenizer, prompt,
                                    req.chat_template_kwargs, params)
    request_id = random_id("chatcmpl")  # from here the engine counts it as waiting
    streams = await before(deadline, start_requests(
        ctx, request_id, [prompt], [params], priority=req.priority, cache_salt=req.cache_salt,
        lora_request=ctx.lora_request(req.model), continuation=req.continuation_of()))
    if req.stream:
        primer = "" if req.continuation is None else await ctx.decode(
            req.continuation.token_ids)
        body = _stream(ctx, req, request_id, model, streams,
                       _StreamPlan(stop_hold(params), deadline, split, prompt, primer))
        return StreamingResponse(body, media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, collect(streams, deadline))
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        message, calls = _message(plan, c.text, split)
        choices.append(ChatChoice(
            index=c.index, message=message, stop_reason=c.stop_reason,
            finish_reason=c.finish_reason if plan is None else finish_reason(calls,
                                                                             c.finish_reason),
            logprobs=_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, req.top_logprobs or 0)))
    if not req.logprobs:
        for choice in choices:
            choice.logprobs = None
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage_of([out], ctx.prompt_tokens_details,
                                                     req.continued_tokens),
                                      prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs),
                                      kv_transfer_params=out.kv_transfer_params)
    body = response.model_dump()
    if req.return_token_ids:  # vLLM's: the prompt's ids on the response, each choice's its own
        body["prompt_token_ids"] = prompt
        for choice, c in zip(body["choices"], sorted(out.outputs, key=lambda c: c.index)):
            choice["token_ids"] = list(c.token_ids)
    return JSONResponse(body)


def _message(plan: ToolPlan | None, text: str, split: Splitters | None
             ) -> tuple[ChatResponseMessage, list[dict[str, Any]]]:
    """A finished choice's message: reasoning split off first, tool calls parsed from the rest."""
    reasoning, content = split_whole(split, text)
    calls: list[dict[str, Any]] = []
    if plan is not None:
        content, calls = parse_output(plan, content)
    if split is not None and not content:
        content = None
    return ChatResponseMessage(content=content, reasoning_content=reasoning, reasoning=reasoning,
                               tool_calls=calls or None), calls


def _logprobs(tokenizer: Any, token_ids: Sequence[int], entries: list[dict[int, Logprob]] | None,
              k: int) -> ChatLogProbs | None:
    if entries is None:
        return None
    content = []
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        content.append(ChatTokenLogprob(
            token=text, logprob=_or_inf(logprob_of(entry, tid)), bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode()))
                          for t, lp in top_logprobs(tokenizer, entry, k)]))
    return ChatLogProbs(content=content)


def _or_inf(value: float | None) -> float:
    return float("-inf") if value is None else value


@dataclass
class _StreamPlan:
    hold: int  # characters held back for a possible stop string
    deadline: float | None
    split: Splitters | None  # the reasoning parser's splitters
    prompt: list[int]  # the prompt's token ids (return_token_ids)
    primer: str  # a continuation's text: the parsers' state starts after it


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, request_id: str, model: str,
                  streams: list[RequestStream], sp: _StreamPlan) -> AsyncIterator[str]:
    """The SSE events of a streamed chat completion. The events of one engine output go out in
    one write (n choices, a reasoning and a content chunk), and the last with the usage chunk
    and [DONE]. Content chunks are framed by chunk_json; reasoning and tool-call chunks by their
    models. With return_token_ids a choice's token ids ride on its next chunk (a parser may hold
    text back: its ids wait with it)."""
    framer = ChunkFramer("chat.completion.chunk", request_id, model, int(time.time()))
    pending: dict[int, list[int]] = {}  # token ids of each choice not yet sent

    def take(index: int) -> list[int] | None:
        return pending.pop(index, []) if req.return_token_ids else None

    def chunk(choices: list[ChatStreamChoice], usage: str = "null",
              ids: list[int] | None = None) -> str:
        return framer.event([with_fields(c.model_dump_json(), token_ids=ids if j == 0 else None)
                             for j, c in enumerate(choices)], usage)

    continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
    indices = [req.continuation.index] if req.continuation is not None else list(range(req.n))
    # the role first, as OpenAI does (the prompt's ids on the first chunk: vLLM's)
    roles = [framer.event([chat_choice(i, "", role="assistant")]) for i in indices]
    if req.return_token_ids:
        roles[0] = event_with(roles[0], prompt_token_ids=sp.prompt)
    yield "".join(roles)
    tracker = StreamTracker(hold=sp.hold)
    plan = req.tool_plan()
    tools = {i: ToolCallStream(plan) for i in indices} if plan is not None else {}
    splitters = {i: sp.split() for i in indices} if sp.split is not None else {}
    if sp.primer:  # restart the parsers from the whole text: its first part is delivered
        for i in indices:
            _prime(splitters.get(i), tools.get(i), sp.primer)
    last: RequestOutput | None = None
    tail = ""  # the finished output's events, sent with the usage chunk and [DONE]
    try:
        async for _, out in until(sp.deadline, merge_streams(streams)):
            last = out
            events: list[str] = []
            # the same for each of the output's choices: built once per engine output
            usage = usage_text([out], ctx.prompt_tokens_details, req.continued_tokens) \
                if continuous else "null"
            for c in out.outputs:
                delta = tracker.delta(c.index, c)
                if delta is None:
                    continue
                pending.setdefault(c.index, []).extend(delta.token_ids)
                lp = _logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs,
                               req.top_logprobs or 0) if req.logprobs else None
                if splitters.get(c.index) is not None:
                    reasoning, text = split_delta(splitters[c.index], delta.text,
                                                  delta.finish_reason is not None)
                    if reasoning:
                        said = DeltaMessage(reasoning_content=reasoning, reasoning=reasoning)
                        events.append(chunk([ChatStreamChoice(index=c.index, delta=said,
                                                              logprobs=lp)], usage, take(c.index)))
                        lp = None
                    if not text and delta.finish_reason is None:
                        continue
                    delta = dataclasses.replace(delta, text=text)
                if c.index in tools:
                    pieces = _tool_chunks(c.index, tools[c.index], delta, lp)
                    events += [chunk([piece], usage, take(c.index) if k == 0 else None)
                               for k, piece in enumerate(pieces)]
                    continue
                content = delta.text if delta.text or splitters.get(c.index) is None else None
                events.append(framer.event([with_fields(chat_choice(
                    c.index, content, logprobs=lp, finish_reason=delta.finish_reason,
                    stop_reason=delta.stop_reason), token_ids=take(c.index))], usage))
            if out.finished:
                tail += "".join(events)
            elif events:
                yield "".join(events)
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield tail + stream_failure(exc)
        return
    if req.include_usage and last is not None:
        tail += framer.event([], usage_text([last], ctx.prompt_tokens_details,
                                            req.continued_tokens))
    yield tail + SSE_DONE


def _prime(split: Any, tools: ToolCallStream | None, text: str) -> None:
    """Feed a continuation's text to a choice's reasoning splitter and tool-call parser, their
    output dropped (the client has it): they go on as after an uninterrupted stream."""
    if split is not None:
        _, text = split_delta(split, text, False)
    if tools is not None and text:
        tools.feed(text)


def _tool_chunks(index: int, stream: ToolCallStream, delta: Delta, lp: ChatLogProbs | None
                 ) -> list[ChatStreamChoice]:
    """A tool-calling choice's chunks for one delta: text or call fragments as they become
    safe to send, then (at the end) the calls and finish_reason "tool_calls". Text and calls
    that come in one delta go out as two chunks, text first (as OpenAI's): clients read a
    chunk's content or its tool_calls (vLLM's xLAM example prints one or the other)."""
    fields = [{key: value} for key, value in (stream.feed(delta.text) or {}).items()]
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
