"""AsyncEngine: one background thread steps an LLMEngine; asyncio callers get a stream per request.

`LLMEngine` is not thread-safe, so only the engine thread touches it. Callers on the event loop send
commands (add, abort, stop) through a thread-safe queue that the thread applies between steps;
a step's outputs go back with one `loop.call_soon_threadsafe` into the requests' asyncio queues.
An idle engine thread blocks on the command queue, so it costs nothing while no request runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvserve.engine.errors import KVServeError
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sample.sampling_params import SamplingParams

if TYPE_CHECKING:  # for annotations only: llm_engine pulls in torch and the model code
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.core.kv_events import KVEvent
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.engine.sizing.memory import MemoryBudget
    from kvserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class EngineDeadError(KVServeError):
    """The engine thread stopped after an error; the process should be restarted."""


class EngineDrainingError(KVServeError):
    """The engine is shutting down and takes no new requests."""


class RequestAbortedError(KVServeError):
    """The request was aborted by the server (shutdown) before it finished."""


class EngineObserver(Protocol):
    """Hooks the engine thread calls (metrics, the Redis prefix-index publisher)."""

    def request_added(self, request_id: str, arrival: float) -> None: ...

    def request_aborted(self, request_id: str) -> None: ...

    def after_step(self, outputs: list[RequestOutput], stats: EngineStats, events: list[KVEvent],
                   engine: LLMEngine) -> None: ...


class RequestStream:
    """The outputs of one request, consumed on the event loop with `async for`.

    Outputs are cumulative, so a slow reader skips to the newest one. Leaving the loop early
    (client gone, task cancelled) aborts the request and its KV blocks go back to the pool.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 abandon: Any) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._abandon = abandon

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: hand an output (or an error) to the reader."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                while not self._queue.empty() and not isinstance(item, BaseException):
                    item = self._queue.get_nowait()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            self._abandon(self.request_id, aborted=not self.finished)
            self.finished = True


def put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Engine thread: hand one step's outputs to their readers with one wake-up of each event
    loop, not one per stream (each `call_soon_threadsafe` writes to the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
    for stream, item in items:
        by_loop.setdefault(stream._loop, []).append((stream._queue, item))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_batch, batch)
        except RuntimeError:  # the loop is closed: nobody is reading any more
            pass


def _put_batch(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival: float
    stream: RequestStream
    accepted: asyncio.Future
    lora_request: Any = None
    continuation: Any = None  # sample/continuation.Continuation


@dataclass
class _Call:
    """Run an LLMEngine method on the engine thread (adapters: add_lora, remove_lora, ...)."""

    method: str
    args: tuple
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Stop:
    pass


@dataclass
class _State:
    """Event-loop-side bookkeeping (only the loop thread touches it)."""

    active: set[str] = field(default_factory=set)
    pending_adds: int = 0
    idle: asyncio.Event | None = None


class AsyncEngine:
    """Runs `engine` in its own thread; `add_request` returns a RequestStream."""

    def __init__(self, engine: LLMEngine, observers: Sequence[EngineObserver] = (),
                 idle_tick: float | None = None) -> None:
        self.engine = engine
        # Fixed for the engine's life, so the server reads them here, not through self.engine.
        self.config: EngineConfig = engine.config
        self.memory_budget: MemoryBudget = engine.memory_budget
        self.observers = list(observers)
        self.idle_tick = idle_tick  # wake up this often when idle (observers that poll), or never
        self.last_stats: EngineStats | None = None
        self.resident_adapters: tuple[str, ...] = ()  # refreshed by the engine thread
        self.draining = False
        self.error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._state = _State()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs: Any) -> AsyncEngine:
        from kvserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine.from_config(config), **kwargs)

    # ---- properties the server reads ----------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """Values for sampling fields a request leaves out (the model's generation config)."""
        return self.engine.sampling_defaults


    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Requests accepted and not yet finished or aborted."""
        return len(self._state.active) + self._state.pending_adds

    @property
    def num_waiting(self) -> int:
        """Requests waiting for the scheduler, including those not yet handed to the engine."""
        waiting = getattr(self.last_stats, "num_waiting", 0) if self.last_stats else 0
        return int(waiting) + self._state.pending_adds

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
            self._thread.start()

    async def _drain(self, grace_period: float) -> int:
        """Refuse new requests and wait up to `grace_period` seconds for the running ones to
        finish; how many are still running (to be aborted)."""
        self.draining = True
        idle = self._idle_event()
        if self.num_active and grace_period > 0:
            try:
                await asyncio.wait_for(idle.wait(), timeout=grace_period)
            except TimeoutError:
                logger.warning("grace period of %.0f s over: aborting %d request(s)",
                               grace_period, self.num_active)
        return self.num_active

    async def shutdown(self, grace_period: float = 30.0) -> int:
        """Refuse new requests, let running ones finish for up to `grace_period` seconds, abort
        the rest and stop the thread. Returns how many requests were aborted."""
        aborted = await self._drain(grace_period)
        self._inbox.put(_Stop())
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        return aborted

    def stop(self) -> None:
        """Synchronous shutdown with no grace period (AsyncLLM.shutdown): abort what runs and
        join the engine thread."""
        self.draining = True
        self._inbox.put(_Stop())
        if self._thread is not None:
            self._thread.join()

    def _idle_event(self) -> asyncio.Event:
        if self._state.idle is None:
            self._state.idle = asyncio.Event()
        if not self.num_active:
            self._state.idle.set()
        return self._state.idle

    # ---- requests (event loop) ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          *, priority: int = 0, cache_salt: str | None = None,
                          arrival: float | None = None, lora_request: Any = None,
                          continuation: Any = None) -> RequestStream:
        """Hand a request to the engine; returns once the engine accepted it (InvalidRequestError
        and friends are raised here, before any output)."""
        self.check_accepting()
        loop = asyncio.get_running_loop()
        if params.constraint is not None:
            # Compiled here, off the engine thread (the engine's own compile is then a cache
            # hit); a schema that does not compile is refused before the request is queued.
            await loop.run_in_executor(None, self.engine.grammars.compile, params.constraint)
        stream = RequestStream(request_id, loop, self._abandon)
        accepted = loop.create_future()
        self._state.pending_adds += 1
        self._clear_idle()
        self._inbox.put(_Add(request_id, prompt, params, priority, cache_salt,
                             time.monotonic() if arrival is None else arrival, stream, accepted,
                             lora_request, continuation))
        await accepted
        return stream

    # ---- LoRA adapters (vLLM's engine client: run on the engine thread) -----------------------
    async def add_lora(self, lora_request: Any) -> bool:
        return await self._call("add_lora", lora_request)

    async def remove_lora(self, name_or_id: str | int) -> bool:
        return await self._call("remove_lora", name_or_id)

    async def list_loras(self) -> list[Any]:
        return await self._call("list_loras")

    def resident_loras(self) -> list[str]:
        """The adapters held in memory as of the last step (any thread: a snapshot)."""
        return list(self.resident_adapters)

    async def _call(self, method: str, *args: Any) -> Any:
        self.check_accepting()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(_Call(method, args, loop, done))
        return await done

    def check_accepting(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error!r}")
        if self.draining:
            raise EngineDrainingError("the server is shutting down; retry on another replica")
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running (call start())")

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort requests (thread-safe); their blocks are freed before the next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._inbox.put(_Abort(ids))

    def _abandon(self, request_id: str, aborted: bool) -> None:
        if aborted:
            self.abort(request_id)
        self._state.active.discard(request_id)
        self._maybe_idle()

    def _clear_idle(self) -> None:
        if self._state.idle is not None:
            self._state.idle.clear()

    def _maybe_idle(self) -> None:
        if self._state.idle is not None and not self.num_active:
            self._state.idle.set()

    def _accepted(self, cmd: _Add, exc: BaseException | None) -> None:
        """Loop side of an add: resolve the caller's future (or abort if it went away)."""
        self._state.pending_adds -= 1
        if exc is None:
            self._state.active.add(cmd.request_id)
        if cmd.accepted.cancelled():
            if exc is None:
                self._abandon(cmd.request_id, aborted=True)
        elif exc is None:
            cmd.accepted.set_result(None)
        else:
            cmd.accepted.set_exception(exc)
        self._maybe_idle()

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._refresh_observers([])  # gauges and the publisher see the empty engine at once
            while True:
                commands = self._next_commands()
                if not self._apply(commands):
                    break
                outputs = self.engine.step() if self.engine.has_runnable_requests() else []
                self._fail_requests(self.engine.take_request_errors())
                self._dispatch(outputs)
                self._refresh_observers(outputs)
        # A request's own failure is handled at add or inside LLMEngine.step; what reaches here is
        # an engine fault (a kernel error, a lost device): the engine is dead.
        except BaseException as exc:  # noqa: BLE001 - tell everyone
            logger.exception("engine thread failed")
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))
            self._drain_inbox_after_failure()
        finally:
            self._fail_all(RequestAbortedError("the server shut down before this request finished"))

    def _next_commands(self) -> list[Any]:
        """Commands queued since the last step; blocks (up to idle_tick) when nothing runs."""
        commands: list[Any] = []
        if not self.engine.has_runnable_requests():  # idle, or paused
            try:
                commands.append(self._inbox.get(timeout=self.idle_tick))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[Any]) -> bool:
        """Apply commands in order; False on stop."""
        for cmd in commands:
            if isinstance(cmd, _Stop):
                self._abort_in_engine(list(self._streams), notify=RequestAbortedError(
                    "the server shut down before this request finished"))
                return False
            if isinstance(cmd, _Abort):
                self._abort_in_engine(cmd.request_ids)
            elif isinstance(cmd, _Call):
                self._call_in_engine(cmd)
            else:
                self._add_in_engine(cmd)
        return True

    def _call_in_engine(self, cmd: _Call) -> None:
        result: Any = None
        exc: BaseException | None = None
        try:
            result = getattr(self.engine, cmd.method)(*cmd.args)
        except Exception as e:  # noqa: BLE001 - handed to the caller (LoRAError, ...)
            exc = e
        self.resident_adapters = tuple(self.engine.resident_loras())

        def resolve() -> None:
            if cmd.done.cancelled():
                return
            if exc is None:
                cmd.done.set_result(result)
            else:
                cmd.done.set_exception(exc)
        try:
            cmd.loop.call_soon_threadsafe(resolve)
        except RuntimeError:  # loop closed
            pass

    def _add_in_engine(self, cmd: _Add) -> None:
        exc: BaseException | None = None
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                    arrival_time=cmd.arrival, priority=cmd.priority,
                                    cache_salt=cmd.cache_salt, lora_request=cmd.lora_request,
                                    continuation=cmd.continuation)
        except Exception as e:  # noqa: BLE001 - handed to the caller (InvalidRequestError, ...)
            exc = e
        else:
            self._streams[cmd.request_id] = cmd.stream
            for obs in self.observers:
                obs.request_added(cmd.request_id, cmd.arrival)
        try:
            cmd.stream._loop.call_soon_threadsafe(self._accepted, cmd, exc)
        except RuntimeError:  # loop closed
            pass

    def _abort_in_engine(self, request_ids: list[str],
                         notify: BaseException | None = None) -> None:
        live = [rid for rid in request_ids if rid in self._streams]
        if not live:
            return
        self.engine.abort_request(live)
        for rid in live:
            stream = self._streams.pop(rid)
            if notify is not None:
                stream.put(notify)
            for obs in self.observers:
                obs.request_aborted(rid)

    def _fail_requests(self, errors: dict[str, BaseException]) -> None:
        """Requests that failed on their own in the last step: their readers get the error, the
        loop goes on for everyone else (the engine already aborted them and freed their blocks)."""
        for rid, exc in errors.items():
            stream = self._streams.pop(rid, None)
            if stream is None:
                continue
            stream.put(exc)
            for obs in self.observers:
                obs.request_aborted(rid)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Engine (or output) thread: each output to its request's stream, one loop wake-up."""
        ready = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            ready.append((stream, out))
            if out.finished:  # the event loop may have dropped it meanwhile (an abort)
                self._streams.pop(out.request_id, None)
        put_all(ready)

    def _refresh_observers(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.get_stats()
        # Always drained, so events never pile up; the host tier's too, for tier-aware routing.
        events = self.engine.drain_kv_events(("device", "host"))
        self.last_stats = stats
        self.resident_adapters = tuple(self.engine.resident_loras())
        for obs in self.observers:
            try:
                obs.after_step(outputs, stats, events, self.engine)
            except Exception:  # noqa: BLE001 - an observer must never stop generation
                logger.exception("engine observer %r failed", obs)

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(exc)

    def _drain_inbox_after_failure(self) -> None:
        """Reject adds that were queued when the engine died."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    cmd.stream._loop.call_soon_threadsafe(
                        self._accepted, cmd, EngineDeadError(f"the engine failed: {self.error!r}"))
                except RuntimeError:
                    pass
            elif isinstance(cmd, _Call):
                dead = EngineDeadError(f"the engine failed: {self.error!r}")
                try:
                    cmd.loop.call_soon_threadsafe(
                        lambda c=cmd: c.done.cancelled() or c.done.set_exception(dead))
                except RuntimeError:
                    pass
