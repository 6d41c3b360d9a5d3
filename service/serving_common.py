"""What completions and chat share: model names, admission, context-length checks, starting engine
requests, merging their streams, disconnect handling, streaming deltas, usage and logprobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineDrainingError,
                                         RequestAbortedError, RequestStream)
from kvserve.engine.errors import InvalidRequestError
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.service.errors import APIError, error_body, validation_error
from kvserve.service.protocol import (DEFAULT_LIMITS, RequestLimits, UsageInfo,
                                      check_prompt_tokens, parse_json_object)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServingContext:
    """What a request handler needs: the engine, the served names and the admission limits."""

    engine: AsyncEngine
    served_model_names: list[str]
    tokenizer: Any  # the HTTP thread's own copy (the engine thread decodes with another)
    max_waiting: int | None = None
    limits: RequestLimits = DEFAULT_LIMITS

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def resolve_model(self, requested: str | None) -> str:
        """The name to answer with; 404 for a model this server does not serve."""
        if requested is None or requested in self.served_model_names:
            return self.model_name
        raise APIError(404, f"The model `{requested}` does not exist; this server serves "
                       f"{self.served_model_names}.", param="model", code="model_not_found")

    def admit(self) -> None:
        """503 while draining or dead, 429 when the waiting queue is full."""
        try:
            self.engine.check_accepting()
        except (EngineDrainingError, EngineDeadError) as exc:
            raise unavailable(exc) from exc
        if self.max_waiting is not None and self.engine.num_waiting >= self.max_waiting:
            raise APIError(429, f"the server has {self.engine.num_waiting} requests waiting "
                           f"(--max-waiting {self.max_waiting}); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})


def unavailable(exc: BaseException) -> APIError:
    """503 + Retry-After for a request the server cannot finish (draining, dead, shut down)."""
    return APIError(503, str(exc), code="service_unavailable", headers={"Retry-After": "1"})


async def parse_body(request: Request, model: type[M],
                     limits: RequestLimits = DEFAULT_LIMITS) -> M:
    """The JSON body as `model`, checked against `limits`; 400 in OpenAI's shape for bad JSON,
    a bad field or one over a cap."""
    try:
        data = parse_json_object(await request.body(), limits.max_json_depth)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), code="invalid_json") from exc
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    parsed.check(limits)  # type: ignore[attr-defined]
    return parsed


def check_prompts(ctx: ServingContext, prompts: Sequence[list[int]], param: str) -> None:
    check_prompt_tokens([len(p) for p in prompts], ctx.limits, param)


def max_tokens_for(ctx: ServingContext, prompt_len: int, requested: int | None,
                   param: str = "max_tokens", prompt_param: str = "prompt") -> int:
    """max_tokens for one prompt: the request's, or what fits; 400 past the context length."""
    limit = ctx.max_model_len
    if prompt_len >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, your prompt is "
            f"{prompt_len} tokens; shorten it.", param=prompt_param)
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
            f"completion). Reduce the prompt or {param}.", param=param)
    return requested


async def start_requests(ctx: ServingContext, base_id: str, prompts: Sequence[list[int]],
                         params: Sequence[SamplingParams], *, priority: int = 0,
                         cache_salt: str | None = None) -> list[RequestStream]:
    """One engine request per prompt; if one is refused, the ones already started are aborted."""
    arrival = time.monotonic()
    streams: list[RequestStream] = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            streams.append(await ctx.engine.add_request(
                f"{base_id}-{i}", ids, p, priority=priority, cache_salt=cache_salt,
                arrival=arrival))
    except BaseException as exc:
        ctx.engine.abort([s.request_id for s in streams])
        if isinstance(exc, (EngineDrainingError, EngineDeadError)):
            raise unavailable(exc) from exc
        raise
    return streams


async def merge_streams(streams: Sequence[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several request streams as they come."""
    if len(streams) == 1:
        outputs = aiter(streams[0])
        try:
            async for out in outputs:
                yield 0, out
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(streams: Sequence[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream (non-streaming requests); 503 + Retry-After when the
    server cut them off (drain past its grace period, a dead engine)."""
    final: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge_streams(streams):
            final[i] = out
    except (EngineDeadError, EngineDrainingError, RequestAbortedError) as exc:
        raise unavailable(exc) from exc
    return [f for f in final if f is not None]


class ClientDisconnected(Exception):
    """The HTTP client went away before the answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client leaves."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def engine_error_status(exc: BaseException) -> int:
    return 503 if isinstance(exc, (EngineDeadError, EngineDrainingError, RequestAbortedError)) \
        else 500


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump_json(exclude_unset=False)
    elif isinstance(payload, dict):
        payload = json.dumps(payload)
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    return sse(error_body(engine_error_status(exc), str(exc)))


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ChoiceCursor:
    """What was already streamed of one choice: text length and token count."""

    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    offset: int  # characters streamed before this delta


@dataclass
class StreamTracker:
    """Turns cumulative CompletionOutputs into deltas, one cursor per choice index.

    While a choice runs, the last `hold` characters are held back: they could be the start of a
    stop string that the engine cuts off once it completes.
    """

    hold: int = 0
    cursors: dict[int, ChoiceCursor] = field(default_factory=dict)

    def delta(self, index: int, c: CompletionOutput) -> Delta | None:
        cur = self.cursors.setdefault(index, ChoiceCursor())
        if cur.finished:
            return None
        done = c.finish_reason is not None
        end = len(c.text) if done else max(len(c.text) - self.hold, cur.text_len)
        text = c.text[cur.text_len:end]
        tokens = c.token_ids[cur.num_tokens:]
        logprobs = c.logprobs[cur.num_tokens:] if c.logprobs is not None else None
        if not text and not done:
            return None
        delta = Delta(text, list(tokens), logprobs, c.finish_reason, c.stop_reason, cur.text_len)
        cur.text_len, cur.num_tokens, cur.finished = end, len(c.token_ids), done
        return delta


def stop_hold(params: SamplingParams) -> int:
    if params.include_stop_str_in_output or not params.stop_strings:
        return 0
    return max(len(s) for s in params.stop_strings) - 1


def usage_of(outputs: Sequence[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo.of(prompt, completion, cached)


def token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_logprobs(tokenizer: Any, entry: dict[int, float], k: int) -> list[tuple[str, float]]:
    """The k most likely tokens of one position, as (text, logprob), best first."""
    best = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return [(token_text(tokenizer, tid), lp) for tid, lp in best]
