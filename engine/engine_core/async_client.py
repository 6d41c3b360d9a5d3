"""AsyncMPEngine: the server's engine when the core runs in its own process. The same interface
as the in-thread `AsyncEngine` (streams, drain, observers); one output thread here reads the
core's step messages, detokenises (ClientOutputProcessor) and hands outputs to the request streams
and the observers (metrics, the prefix-index publisher) while the core runs the next step."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvserve.engine.async_engine import (AsyncEngine, EngineDeadError, EngineObserver,
                                         RequestAbortedError, RequestStream, _Add, _State)
from kvserve.engine.engine_core.core_client import POLL_S, CoreClient
from kvserve.engine.engine_core.messages import (AbortRequests, AddRequest, CoreDead,
                                                 CoreStopped, StepMessage)
from kvserve.engine.engine_core.client_outputs import ClientOutputProcessor
from kvserve.engine.sample.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.engine.async_engine")
# How long a stopping server waits for the core to answer its Shutdown (it reads its inbox
# between two steps); past it the core process is terminated.
CORE_STOP_S = 30.0


class AsyncMPEngine(AsyncEngine):
    """Streams of requests served by an engine core process (`client`)."""

    def __init__(self, client: CoreClient, observers: Sequence[EngineObserver] = (),
                 idle_tick: float | None = None) -> None:
        self.client = client
        self.engine = client.engine  # EngineCoreProxy: facts, figures, utility calls
        self.config = client.info.config
        self.memory_budget = client.info.memory_budget
        self.observers = list(observers)
        self.idle_tick = idle_tick  # the core sends a message every second while idle anyway
        self.last_stats: Any = None
        self.steps_seen = 0  # StepMessages the output thread has dispatched
        self.draining = False
        self.error: BaseException | None = None
        self.on_dead: list[Callable[[BaseException], None]] = []  # run once the core is gone
        self.outputs = ClientOutputProcessor(client.info.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, _Add] = {}  # adds the core has not answered yet
        self._state = _State()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self.resident_adapters: tuple[str, ...] = ()  # refreshed after each adapter call

    @property
    def tokenizer(self) -> Any:
        return self.client.info.tokenizer

    @property
    def model_name(self) -> str:
        return self.client.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.client.info.sampling_defaults

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-engine-outputs",
                                            daemon=True)
            self._thread.start()

    async def shutdown(self, grace_period: float = 30.0) -> int:
        """Drain as the in-thread engine does, then stop the core process."""
        aborted = await self._drain(grace_period if self.error is None else 0)
        await asyncio.get_running_loop().run_in_executor(None, self._stop_core)
        return aborted

    def stop(self) -> None:
        self.draining = True
        self._stop_core()

    def _stop_core(self) -> None:
        """Bounded whatever the core does (issue 41): it gets CORE_STOP_S to answer the
        Shutdown, then `close()` terminates it; the output thread is not waited for beyond
        that, as it ends by itself once the sockets are closed."""
        self.client.shutdown()
        self._stopped.wait(CORE_STOP_S if self.client.is_alive() else 0)
        if self._thread is not None:
            self._thread.join(2)
        self.client.close(timeout_s=5.0)

    # ---- requests (event loop) ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          *, priority: int = 0, cache_salt: str | None = None,
                          arrival: float | None = None, **kwargs: Any) -> RequestStream:
        """Hand a request to the core; returns once the core accepted it (its validation
        errors are raised here, before any output). Extra keywords go to `add_request` in the
        core as they are."""
        self.check_accepting()
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self._abandon)
        accepted = loop.create_future()
        arrival = time.monotonic() if arrival is None else arrival
        self._state.pending_adds += 1
        self._clear_idle()
        self._pending[request_id] = _Add(request_id, prompt, params, priority, cache_salt,
                                         arrival, stream, accepted)
        self.outputs.add(request_id, prompt, params, kwargs.get("lora_request"),
                         kwargs.get("continuation"))
        self.client.send(AddRequest(request_id, prompt, params, dict(
            arrival_time=arrival, priority=priority, cache_salt=cache_salt, **kwargs)))
        await accepted
        return stream

    def check_accepting(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        super().check_accepting()

    async def _call(self, method: str, *args: Any) -> Any:
        """An engine method (add_lora, remove_lora, list_loras ...) run in the core, off the
        event loop; the resident-adapter snapshot the heartbeat reads is refreshed with it."""
        self.check_accepting()

        def call() -> tuple[Any, int]:
            try:
                result = self.client.call_utility(method, *args)
                return result, self.client.steps_before_reply
            finally:
                if self.config.enable_lora:
                    self.resident_adapters = tuple(self.client.call_utility("resident_loras"))

        result, steps = await asyncio.to_thread(call)
        await self._caught_up(steps)
        return result

    async def _caught_up(self, steps: int, timeout_s: float = 5.0) -> None:
        """The answer comes on its own socket: wait (bounded) until the output thread has
        dispatched every step the core sent before it, so a call's effect (a pause) is seen
        after those steps' outputs, as in the engine-in-a-thread mode."""
        deadline = time.monotonic() + timeout_s
        while self.steps_seen < steps and time.monotonic() < deadline and self.error is None:
            await asyncio.sleep(0.001)

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            self.outputs.remove(rid)
            if self._streams.pop(rid, None) is not None:
                for obs in self.observers:
                    obs.request_aborted(rid)
        self.client.send(AbortRequests(ids))

    # ---- output thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                msg = self.client.recv(POLL_S)
                if msg is None:
                    if self.client.death is not None:
                        raise EngineDeadError(self.client.death)
                elif isinstance(msg, StepMessage):
                    self._on_step(msg)
                elif isinstance(msg, CoreDead):
                    raise EngineDeadError(f"the engine failed: {msg.reason}")
                elif isinstance(msg, CoreStopped):
                    break
        except BaseException as exc:  # noqa: BLE001 - the core is gone: tell everyone
            logger.error("engine core: %s", exc)
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine failed: {exc}"))
            for hook in self.on_dead:
                hook(exc)
        finally:
            self._fail_all(RequestAbortedError("the server shut down before this request finished"))
            self._stopped.set()

    def _on_step(self, msg: StepMessage) -> None:
        for rid, exc in msg.accepted:
            self._answer_add(rid, exc)
        outputs, stopped = self.outputs.process(msg.deltas)
        if stopped:  # a stop string ended them here: the core frees their blocks
            self.client.send(AbortRequests(stopped))
        self._fail_requests(msg.errors)
        self._dispatch(outputs)
        self.steps_seen += 1
        self.last_stats = msg.stats
        self.engine.alloc_seconds += msg.alloc_seconds
        self.engine.restore_seconds += msg.restore_seconds
        for obs in self.observers:
            try:
                obs.after_step(outputs, msg.stats, msg.events, self.engine)
            except Exception:  # noqa: BLE001 - an observer must never stop generation
                logger.exception("engine observer %r failed", obs)

    def _answer_add(self, request_id: str, exc: BaseException | None) -> None:
        cmd = self._pending.pop(request_id, None)
        if cmd is None:
            return
        if exc is None:
            self._streams[request_id] = cmd.stream
            for obs in self.observers:
                obs.request_added(request_id, cmd.arrival)
        else:
            self.outputs.remove(request_id)
        try:
            cmd.stream._loop.call_soon_threadsafe(self._accepted, cmd, exc)
        except RuntimeError:  # loop closed
            pass

    def _fail_all(self, exc: BaseException) -> None:
        super()._fail_all(exc)
        for rid in list(self._pending):
            self._answer_add(rid, exc)
