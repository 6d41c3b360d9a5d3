"""The engine core process (vLLM's EngineCoreProc): builds the `LLMEngine` (its processor and
`EngineCore`, and with them any tensor-parallel workers; its text is left to the client), then
runs a busy loop: take new requests, aborts and utility calls, step, send one StepMessage
holding every request's new tokens, finish reasons, logprobs, the step's stats and KV events.

While the client handles step N's message, this process already runs step N+1."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import zmq

from kvserve.engine.engine_core.deltas import DeltaTracker
from kvserve.engine.engine_core.messages import (AbortRequests, AddRequest, CoreDead, CoreReady,
                                                 CoreStopped, Shutdown, StepMessage,
                                                 UtilityCall, UtilityResult)
from kvserve.engine.engine_core.serial import decode, encode, portable

logger = logging.getLogger("kvserve.engine.core")

# While idle the core wakes this often: it checks its parent and workers, and sends the stats
# and KV events (the prefix-index heartbeat reads them).
IDLE_TICK_S = 1.0
POLL_OUT_MS = 1000  # how often a core that cannot send checks its parent


def run_engine_core(config: Any, addresses: tuple[str, str, str], parent_pid: int,
                    log_level: int = logging.INFO) -> None:
    """The process's entry point (spawned by `CoreClient`)."""
    # The API process owns shutdown: a Ctrl-C to the terminal's process group must not kill the
    # core before the server has drained it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (core): %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addresses[0])
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(addresses[1])
    utility = ctx.socket(zmq.PUSH)
    utility.connect(addresses[2])
    try:
        EngineCoreProc(config, inbox, outbox, utility, parent_pid).run()
    finally:
        for sock in (inbox, outbox, utility):
            sock.close(linger=2000)  # what was sent last (CoreDead, CoreStopped) still goes
        ctx.term()


class EngineCoreProc:
    def __init__(self, config: Any, inbox: zmq.Socket, outbox: zmq.Socket, utility: zmq.Socket,
                 parent_pid: int) -> None:
        self.config = config
        self.inbox, self.outbox, self.utility = inbox, outbox, utility
        self.parent_pid = parent_pid
        self.tracker = DeltaTracker()
        self.steps_sent = 0  # StepMessages sent: a utility reply says how many came before it
        self.engine: Any = None
        self._accepted: list[tuple[str, BaseException | None]] = []
        self._whole: set[str] = set()  # requests whose text the core makes (sent whole)

    def run(self) -> None:
        from kvserve.engine.llm_engine import LLMEngine

        try:
            self.engine = LLMEngine.from_config(self.config)
        except BaseException as exc:  # noqa: BLE001 - the client raises it
            logger.exception("engine core: start-up failed")
            self._put(self.outbox, encode(CoreDead(_describe(exc), during_startup=True)))
            return
        self.engine.detokenize = False  # the client detokenises
        e = self.engine
        self._put(self.outbox, encode(CoreReady(
            e.model_name, e.max_model_len, e.block_size, e.memory_budget, e.sampling_defaults,
            e.config, e.tokenizer, e.eos_token_ids, e.model_weight_bytes)))
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - an engine fault: tell the client, exit
            logger.exception("engine core failed")
            self._put(self.outbox, encode(CoreDead(_describe(exc))))
        finally:
            self.engine.shutdown()

    def _loop(self) -> None:
        engine = self.engine
        self._send_step([], {})  # the client's gauges and the publisher see the empty engine
        while True:
            if not engine.has_runnable_requests() and not self.inbox.poll(IDLE_TICK_S * 1000):
                self._idle_checks()
                self._send_step([], {})
                continue
            if not self._take_inbox():
                return
            outputs = engine.step() if engine.has_runnable_requests() else []
            self._send_step(outputs, engine.take_request_errors())

    def _idle_checks(self) -> None:
        if os.getppid() != self.parent_pid:  # the API process is gone: nobody to serve
            raise SystemExit("the engine core's parent process exited")
        self.engine.check_health()  # WorkerDiedError for a lost tensor-parallel worker
        self.engine.core.poll_kv_transfers()  # blocks a decode replica has pulled meanwhile

    def _take_inbox(self) -> bool:
        """Apply every queued message in order; False on Shutdown."""
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            msg = decode(data.buffer)
            if isinstance(msg, AddRequest):
                self._add(msg)
            elif isinstance(msg, AbortRequests):
                self.engine.abort_request(msg.request_ids)
            elif isinstance(msg, UtilityCall):
                self._call(msg)
            elif isinstance(msg, Shutdown):
                self.engine.abort_request(list(self.engine.requests))
                self._put(self.outbox, encode(CoreStopped()))
                return False

    def _add(self, msg: AddRequest) -> None:
        try:
            self.engine.add_request(msg.request_id, msg.prompt, msg.params, **msg.kwargs)
        except Exception as exc:  # noqa: BLE001 - handed to the caller (InvalidRequestError...)
            self._accepted.append((msg.request_id, portable(exc)))
        else:
            self._accepted.append((msg.request_id, None))
            if self.engine.requests[msg.request_id].makes_text:
                self._whole.add(msg.request_id)

    def _call(self, msg: UtilityCall) -> None:
        try:
            result = getattr(self.engine, msg.method)(*msg.args, **msg.kwargs)
            reply = UtilityResult(msg.call_id, result, steps_sent=self.steps_sent)
            data = encode(reply)
        except Exception as exc:  # noqa: BLE001 - raised in the caller
            data = encode(UtilityResult(msg.call_id, error=portable(exc),
                                        steps_sent=self.steps_sent))
        self._put(self.utility, data)

    def _put(self, sock: zmq.Socket, data: Any, copy: bool = True) -> None:
        """Send without ever blocking for good: a PUSH socket whose client is gone would wait
        forever, so while it cannot send it checks that its parent still lives (issue 41)."""
        while not sock.poll(POLL_OUT_MS, zmq.POLLOUT):
            if os.getppid() != self.parent_pid:
                raise SystemExit("the engine core's parent process exited")
        sock.send(data, zmq.NOBLOCK, copy=copy)

    def _send_step(self, outputs: list[Any], errors: dict[str, BaseException]) -> None:
        engine = self.engine
        deltas = self.tracker.deltas(outputs, self._whole)
        for rid in [d[0] for d in deltas if d[1]] + list(errors):
            self.tracker.forget(rid)
            self._whole.discard(rid)
        accepted, self._accepted = self._accepted, []
        self._put(self.outbox, encode(StepMessage(
            accepted, deltas, {k: portable(v) for k, v in errors.items()}, engine.get_stats(),
            engine.drain_kv_events(("device", "host")), engine.drain_block_alloc_seconds(),
            engine.drain_restore_seconds(), time.monotonic())), copy=False)
        self.steps_sent += 1


def _describe(exc: BaseException) -> str:
    tb = traceback.format_exception_only(type(exc), exc)
    return "".join(tb).strip()
