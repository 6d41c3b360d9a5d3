"""POST /v1/completions: prompts (text, texts, token ids, vLLM's prompt_embeds) to choices,
streamed as SSE or whole."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.async_engine import RequestStream
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.outputs import Logprob, RequestOutput
from kvserve.engine.prompt_embeds import EmbedsPrompt, load_prompt_embeds, prompt_len
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.request_models import CompletionRequest
from kvserve.service.response_models import (CompletionChoice, CompletionLogProbs,
                                             CompletionResponse, random_id)
from kvserve.service.server.chunk_json import ChunkFramer, completion_choice
from kvserve.service.server.context import ServingContext
from kvserve.service.server.engine_streams import (before, collect, stream_failure,
                                                   merge_streams, start_requests,
                                                   unless_disconnected, until)
from kvserve.service.server.logprobs import (logprob_of, prompt_logprob_values,
                                             prompt_logprobs_json, token_text, top_logprobs)
from kvserve.service.server.stream_deltas import Delta, StreamTracker, stop_hold
from kvserve.service.server.token_ids import with_fields
from kvserve.service.server.usage import usage_of, usage_text
from kvserve.service.sse import SSE_DONE


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> Response:
    model = ctx.resolve_model(req.model)
    deadline = ctx.deadline(raw, asyncio.get_running_loop().time())
    with ctx.admitted():
        # vLLM's order: the prompt embeddings first, then the prompts
        prompts: list[Any] = await before(deadline, _embeds_prompts(ctx, req))
        prompts += await before(deadline, ctx.encode_prompts(req.prompts()))
        ctx.check_prompts(prompts, "prompt")
        wanted = 1 if req.echo_only else req.max_tokens  # echo_only drops its one token
        params = [req.sampling_params(ctx.max_tokens_for(prompt_len(p), wanted), req.logprobs,
                                      ctx.engine.sampling_defaults) for p in prompts]
        echoes = [await ctx.decode(p) for p in prompts] if req.echo else [""] * len(prompts)
    request_id = random_id("cmpl")  # from here the engine counts it as waiting
    streams = await before(deadline, start_requests(
        ctx, request_id, prompts, params, priority=req.priority, cache_salt=req.cache_salt,
        lora_request=ctx.lora_request(req.model), continuation=req.continuation_of()))
    if req.stream:
        body = _stream(ctx, req, request_id, model, streams, params[0], echoes, deadline)
        return StreamingResponse(body, media_type="text/event-stream")
    outputs = await unless_disconnected(raw, collect(streams, deadline))
    choices = [c for i, out in enumerate(outputs) for c in _choices(ctx, req, i, out, echoes[i])]
    response = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage_of(outputs, ctx.prompt_tokens_details,
                                                 req.continued_tokens),
                                  kv_transfer_params=outputs[0].kv_transfer_params)
    body = response.model_dump()
    if req.return_token_ids:  # vLLM's: each choice its ids and its prompt's
        ids = [(c.token_ids, out.prompt_token_ids) for out in outputs
               for c in sorted(out.outputs, key=lambda c: c.index)]
        for choice, (tokens, prompt) in zip(body["choices"], ids):
            choice["token_ids"], choice["prompt_token_ids"] = list(tokens), prompt
    return JSONResponse(body)


async def _embeds_prompts(ctx: ServingContext, req: CompletionRequest) -> list[EmbedsPrompt]:
    """The request's prompt_embeds loaded as vLLM loads them (400 unless the server runs with
    --enable-prompt-embeds; the engine checks their shape), off the event loop since a tensor
    may be large; echo cannot show them."""
    encoded = req.embeds_prompts()
    if not encoded:
        return []
    if req.echo:
        raise InvalidRequestError("Echo is unsupported with prompt embeds.", param="echo")
    return await ctx.tokenizers.run(_load_embeds, encoded, ctx.engine.config.enable_prompt_embeds)


def _load_embeds(_tokenizer: Any, encoded: list[str], enabled: bool) -> list[EmbedsPrompt]:
    return [{"prompt_embeds": load_prompt_embeds(e, enabled)} for e in encoded]


def _choices(ctx: ServingContext, req: CompletionRequest, i: int, out: RequestOutput,
             echo: str) -> list[CompletionChoice]:
    prompt_lps = prompt_logprobs_json(out.prompt_logprobs)
    prompt_part = _echo_logprobs(ctx.tokenizer, out, req.logprobs) if req.echo else None
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        if req.echo_only:  # the prompt alone: the one token generated is dropped
            text, lp = echo, prompt_part
        else:
            text = echo + c.text
            lp = _join(prompt_part, _logprobs(ctx.tokenizer, c.token_ids, c.logprobs,
                                              req.logprobs, len(echo)))
        choices.append(CompletionChoice(
            index=i * req.n + c.index, text=text, finish_reason=c.finish_reason,
            stop_reason=c.stop_reason, logprobs=lp, prompt_logprobs=prompt_lps))
    return choices


def _echo_logprobs(tokenizer: Any, out: RequestOutput, k: int | None
                   ) -> CompletionLogProbs | None:
    """The prompt tokens' part of an echoed choice's logprobs: the first token has none (null,
    as OpenAI's), the others come from the prompt logprobs; offsets start at 0."""
    if k is None or out.prompt_logprobs is None:
        return None
    ids = out.prompt_token_ids
    first = token_text(tokenizer, ids[0])
    rest = _logprobs(tokenizer, ids[1:], prompt_logprob_values(out.prompt_logprobs), k,
                     len(first))
    head = CompletionLogProbs(text_offset=[0], token_logprobs=[None], tokens=[first],
                              top_logprobs=[None])
    return _join(head, rest)


def _join(a: CompletionLogProbs | None, b: CompletionLogProbs | None
          ) -> CompletionLogProbs | None:
    """`a`'s tokens then `b`'s (None when both are None)."""
    if a is None or b is None:
        return a or b
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def _logprobs(tokenizer: Any, token_ids: Sequence[int], entries: list[dict[int, Logprob]] | None,
              k: int | None, offset: int) -> CompletionLogProbs | None:
    """OpenAI's legacy logprobs object of a run of generated tokens."""
    if k is None or entries is None:
        return None
    lp = CompletionLogProbs()
    for tid, entry in zip(token_ids, entries):
        text = token_text(tokenizer, tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob_of(entry, tid))
        top: dict[str, float] = {}
        for token, value in top_logprobs(tokenizer, entry, k):
            top.setdefault(token, value)  # tokens that decode alike: keep the likelier
        lp.top_logprobs.append(top if k else None)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


async def _stream(ctx: ServingContext, req: CompletionRequest, request_id: str, model: str,
                  streams: list[RequestStream], params: SamplingParams,
                  echoes: list[str], deadline: float | None) -> AsyncIterator[str]:
    """The SSE events of streamed completions, framed by chunk_json: one write per engine
    output (its n choices), the last output's with the usage chunk and [DONE]."""
    framer = ChunkFramer("text_completion", request_id, model, int(time.time()))
    tracker = StreamTracker(hold=stop_hold(params))
    latest: dict[int, RequestOutput] = {}
    echoed: set[int] = set()
    with_prompt: set[int] = set()  # choices whose prompt_token_ids were sent
    tail = ""  # the events once every prompt has finished, sent with the usage and [DONE]
    try:
        async for i, out in until(deadline, merge_streams(streams)):
            latest[i] = out
            events: list[str] = []
            for c in out.outputs:
                index = i * req.n + c.index
                delta = tracker.delta(index, c)
                if delta is None:
                    continue
                prefix, prompt_part = "", None
                if req.echo and index not in echoed:
                    prefix = echoes[i]
                    prompt_part = _echo_logprobs(ctx.tokenizer, out, req.logprobs)
                    echoed.add(index)
                ids: dict[str, list[int] | None] = {}
                if req.return_token_ids:  # the prompt's ids on the choice's first chunk
                    ids["token_ids"] = delta.token_ids
                    if index not in with_prompt:
                        ids["prompt_token_ids"] = out.prompt_token_ids
                        with_prompt.add(index)
                events.append(_chunk(ctx, req, framer, index, delta, prefix, prompt_part,
                                     len(echoes[i]), latest, ids))
            if len(latest) == len(streams) and all(o.finished for o in latest.values()):
                tail += "".join(events)
            elif events:
                yield "".join(events)
    except Exception as exc:  # noqa: BLE001 - the stream already started: report in-band
        yield tail + stream_failure(exc)
        return
    if req.include_usage:
        tail += framer.event([], usage_text(list(latest.values()), ctx.prompt_tokens_details,
                                            req.continued_tokens))
    yield tail + SSE_DONE


def _chunk(ctx: ServingContext, req: CompletionRequest, framer: ChunkFramer, index: int,
           delta: Delta, prefix: str, prompt_part: CompletionLogProbs | None, echo_len: int,
           latest: dict[int, RequestOutput], ids: dict[str, list[int] | None]) -> str:
    """One choice's chunk; the first of an echoed choice starts with the prompt (and its
    logprobs). With echo and max_tokens 0 the generated token is not shown."""
    text, lp = prefix, prompt_part
    if not req.echo_only:
        offset = delta.offset + echo_len
        text += delta.text
        lp = _join(lp, _logprobs(ctx.tokenizer, delta.token_ids, delta.logprobs, req.logprobs,
                                 offset))
    usage = "null"
    if req.stream_options and req.stream_options.continuous_usage_stats:
        usage = usage_text(list(latest.values()), ctx.prompt_tokens_details,
                           req.continued_tokens)
    choice = completion_choice(index, text, logprobs=lp, finish_reason=delta.finish_reason,
                               stop_reason=delta.stop_reason)
    return framer.event([with_fields(choice, **ids)], usage)
