"""Engine requests of one HTTP request: started together, their outputs merged as they come,
collected whole, or abandoned when the client leaves."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import Request

from kvserve.engine.async_engine import (EngineDeadError, EngineDrainingError, RequestAbortedError,
                                         RequestStream)
from kvserve.engine.errors import KVServeError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sample.sampling_params import SamplingParams
from kvserve.service.openai_errors import APIError
from kvserve.service.server.context import ServingContext, unavailable
from kvserve.service.server.handback import handback_error, handback_event, handed_back
from kvserve.service.sse import SSE_DONE, sse_error

T = TypeVar("T")


async def start_requests(ctx: ServingContext, base_id: str, prompts: Sequence[list[int]],
                         params: Sequence[SamplingParams], *, priority: int = 0,
                         cache_salt: str | None = None,
                         lora_request: Any = None, continuation: Any = None
                         ) -> list[RequestStream]:
    """One engine request per prompt; if one is refused, the ones already started are aborted.
    `continuation` (one prompt only): output tokens generated elsewhere."""
    arrival = time.monotonic()
    streams: list[RequestStream] = []
    extra = {} if continuation is None else {"continuation": continuation}
    try:
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            streams.append(await ctx.engine.add_request(
                f"{base_id}-{i}", ids, p, priority=priority, cache_salt=cache_salt,
                arrival=arrival, lora_request=lora_request, **extra))
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


class RequestTimedOutError(KVServeError):
    """The request's deadline (--request-timeout, X-Request-Timeout) passed before it finished."""


def timed_out() -> APIError:
    """504 in OpenAI's shape for a request past its deadline (its engine requests are aborted)."""
    return APIError(504, "the request ran past its deadline (--request-timeout or the "
                    "X-Request-Timeout header) and was aborted", code="request_timeout")


async def before(deadline: float | None, work: Awaitable[T]) -> T:
    """`work`, cancelled at `deadline` (event-loop time) with a 504."""
    try:
        async with asyncio.timeout_at(deadline):
            return await work
    except TimeoutError:
        raise timed_out() from None


async def until(deadline: float | None, source: AsyncIterator[T]) -> AsyncIterator[T]:
    """The items of `source` until `deadline` (event-loop time), then RequestTimedOutError.
    Cancelling the pending item closes `source`, which aborts its engine requests."""
    try:
        if deadline is None:  # no timeout scope per item: it costs a few us per streamed token
            async for item in source:
                yield item
            return
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await anext(source)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise RequestTimedOutError(timed_out().message) from None
            yield item
    finally:
        await source.aclose()  # type: ignore[attr-defined]


async def collect(streams: Sequence[RequestStream],
                  deadline: float | None = None) -> list[RequestOutput]:
    """The final output of every stream (non-streaming requests); 503 + Retry-After when the
    server cut them off (drain past its grace period, a dead engine), 504 past the deadline."""
    final: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in until(deadline, merge_streams(streams)):
            final[i] = out
    except (EngineDeadError, EngineDrainingError, RequestAbortedError) as exc:
        if handed_back(exc):  # the drain timeout is over: the router re-issues it elsewhere
            raise handback_error() from exc
        raise unavailable(exc) from exc
    except RequestTimedOutError:
        raise timed_out() from None
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


def stream_failure(exc: BaseException) -> str:
    """The last events of a stream that `exc` cut off: the hand-back event alone when the drain
    timeout ended it (service/server/handback.py), else an error event and [DONE]."""
    if handed_back(exc):
        return handback_event()
    return sse_error(engine_error_status(exc), str(exc)) + SSE_DONE


def engine_error_status(exc: BaseException) -> int:
    """The status of a stream cut off by the engine: 503 (draining, dead, aborted), 504 (past
    its deadline), else 500."""
    if isinstance(exc, RequestTimedOutError):
        return 504
    return 503 if isinstance(exc, (EngineDeadError, EngineDrainingError, RequestAbortedError)) \
        else 500

