"""Client side of the engine core process: starts it, sends requests and aborts, receives its
step messages, and calls any engine method in it as an RPC (`call_utility`, vLLM's pattern).

Three ZMQ sockets over IPC: requests (client PUSH -> core PULL), step messages (core PUSH ->
client PULL, read by one thread) and utility answers (core PUSH -> client PULL), the last on
their own so that a thread reading step messages may itself call a utility."""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq

from kvserve.engine.cpu_threads import spin_default_for_children

from kvserve.engine.engine_core.core_process import run_engine_core
from kvserve.engine.engine_core.messages import (CoreDead, CoreReady, Shutdown, UtilityCall,
                                                 UtilityResult)
from kvserve.engine.engine_core.serial import decode, encode
from kvserve.engine.errors import KVServeError

logger = logging.getLogger("kvserve.engine.core")

POLL_S = 0.5  # how often a waiting reader checks that the core process still lives
# The most `close()` waits for ZMQ's context to terminate; past it the context is left to the
# process's exit rather than hang a shutdown (issue 41: a SIGTERM'd server hung in term()).
TERM_TIMEOUT_S = 5.0


class EngineCoreDiedError(KVServeError):
    """The engine core process exited or failed; the engine cannot continue."""


class CoreClient:
    """One engine core process and the sockets to it (`info`: what it told of its engine)."""

    def __init__(self, config: Any) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvserve-core-")
        addresses = tuple(f"ipc://{self._dir}/{name}" for name in ("in", "out", "utility"))
        self._ctx = zmq.Context()
        # Every socket of this context drops what it has not sent when closed: a message queued
        # for a core that is gone must never hold up `term()`.
        self._ctx.linger = 0
        self._requests = self._ctx.socket(zmq.PUSH)
        self._requests.bind(addresses[0])
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.bind(addresses[1])
        self._utility = self._ctx.socket(zmq.PULL)
        self._utility.bind(addresses[2])
        self._send_lock = threading.Lock()  # the event loop, the output thread and callers send
        self._utility_lock = threading.Lock()
        self._close_lock = threading.Lock()  # close() from the output thread, atexit or a caller
        self._call_ids = itertools.count()
        self.steps_before_reply = 0  # the last utility reply's steps_sent
        self.death: str | None = None  # why the core is gone, once it is
        self.closed = False
        self._shutdown_sent = False
        ctx = multiprocessing.get_context("spawn")  # no lock of this process inherited
        self.process = ctx.Process(
            target=run_engine_core, name="kvserve-engine-core", daemon=False,
            args=(config, addresses, os.getpid(), logging.getLogger("kvserve").getEffectiveLevel()))
        with spin_default_for_children():
            self.process.start()
        logger.info("engine core: process %d, starting the engine", self.process.pid)
        try:
            self.info: CoreReady = self._wait_ready()
        except BaseException:
            self.close()
            raise
        self.engine = EngineCoreProxy(self)
        # A script that never calls shutdown(): stop the core before multiprocessing's own exit
        # hook joins it (atexit runs hooks last-registered first), or the exit would wait forever.
        atexit.register(self.close, 5.0)

    def _wait_ready(self) -> CoreReady:
        while True:
            msg = self.recv(POLL_S)
            if isinstance(msg, CoreReady):
                return msg
            if isinstance(msg, CoreDead):
                raise EngineCoreDiedError(f"the engine failed to start: {msg.reason}")
            if msg is None and self.death is not None:
                raise EngineCoreDiedError(f"the engine failed to start: {self.death}")

    # ---- messages --------------------------------------------------------------------------
    def send(self, message: Any, timeout_s: float | None = None) -> bool:
        """Queue `message` for the core; False if it was dropped. Never blocks on a core that is
        gone: a PUSH socket without a peer waits for one forever, so a message to a dead core is
        dropped (its requests are failed by the output thread, which sees the death), and so is
        one that a live core has not taken within `timeout_s` (None: no limit)."""
        data = encode(message)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._send_lock:
            while not self.closed:
                if deadline is not None and time.monotonic() > deadline:
                    return False
                try:
                    # Copied (not zero-copy): a zero-copy frame still queued at close is freed
                    # through pyzmq's garbage-collector thread, one more party to term().
                    self._requests.send(data, zmq.NOBLOCK)
                    return True
                except zmq.Again:  # the queue is full, or the core stopped reading
                    if not self._check_alive():
                        return False
                    self._requests.poll(POLL_S * 1000, zmq.POLLOUT)
        return False

    def recv(self, timeout_s: float) -> Any:
        """The next message from the core, or None after `timeout_s` (then `death` says
        whether the core process is gone). One thread reads."""
        if not self._outputs.poll(timeout_s * 1000):
            self._check_alive()
            return None
        return decode(self._outputs.recv(copy=False).buffer)

    def _check_alive(self) -> bool:
        if self.death is None and not self.process.is_alive():
            self.death = f"the engine core process exited (exit code {self.process.exitcode})"
        return self.death is None

    def is_alive(self) -> bool:
        return self._check_alive()

    def call_utility(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`engine.<method>(*args, **kwargs)` run in the core between two steps; its result,
        or its exception raised here. Thread-safe (calls are served one at a time)."""
        with self._utility_lock:
            call_id = next(self._call_ids)
            self.send(UtilityCall(call_id, method, args, kwargs))
            while True:
                if not self._utility.poll(POLL_S * 1000):
                    if not self._check_alive():
                        raise EngineCoreDiedError(f"{method}() got no answer: {self.death}")
                    continue
                reply: UtilityResult = decode(self._utility.recv())
                if reply.call_id != call_id:  # the answer of a call whose caller gave up
                    continue
                self.steps_before_reply = reply.steps_sent
                if reply.error is not None:
                    raise reply.error
                return reply.result

    # ---- lifecycle -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Ask the core to stop (it answers CoreStopped on the step channel); once only: a core
        that has answered closes its sockets, and a second request would wait (in `send`) until
        it has exited."""
        if self._shutdown_sent or not self.is_alive():
            return
        self._shutdown_sent = True
        self.send(Shutdown(), timeout_s=5.0)  # a core that reads no more is stopped by close()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the core (and its tensor-parallel workers) and release the sockets; idempotent,
        thread-safe, and bounded: about `timeout_s` + 10 s however the core or ZMQ behave."""
        with self._close_lock:
            if self.closed:
                return
            atexit.unregister(self.close)
            self._stop_process(timeout_s)
            with self._send_lock:
                self.closed = True
                for sock in (self._requests, self._outputs, self._utility):
                    sock.close(linger=0)
            if not term_within(self._ctx, TERM_TIMEOUT_S):
                logger.warning("engine core sockets: ZMQ did not terminate in %.0f s; left to "
                               "the process exit", TERM_TIMEOUT_S)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _stop_process(self, timeout_s: float) -> None:
        if self.process.is_alive():
            self.shutdown()
            self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %.0f s: terminating it", timeout_s)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def __del__(self) -> None:  # an LLM dropped without shutdown(): no orphaned core
        try:
            if not self.closed and self.process.is_alive():
                self.process.kill()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def term_within(ctx: zmq.Context, timeout_s: float) -> bool:
    """`ctx.term()`, waited for at most `timeout_s`; False if it is still waiting. term() blocks
    while any socket of the context is open or still owes a message, so it runs in a daemon
    thread: a shutdown path must end whatever a peer or another thread does."""
    done = threading.Thread(target=ctx.term, name="kvserve-zmq-term", daemon=True)
    done.start()
    done.join(timeout_s)
    return not done.is_alive()


class EngineCoreProxy:
    """The engine as its client sees it: fixed facts from `CoreReady`, the figures the last step
    message carried, and any other method called in the core (`proxy.reset_prefix_cache()`)."""

    def __init__(self, client: CoreClient) -> None:
        self._client = client
        self.alloc_seconds: list[float] = []
        self.restore_seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        info = self._client.info
        if hasattr(info, name):
            return getattr(info, name)
        from kvserve.engine.llm_engine import LLMEngine

        # Only the engine's methods are calls into the core: `getattr(engine, "x", None)` must
        # stay None for anything else (a lambda there would turn each such probe into an RPC).
        if not callable(getattr(LLMEngine, name, None)):
            raise AttributeError(f"the engine core has no method {name!r}")
        return lambda *args, **kwargs: self._client.call_utility(name, *args, **kwargs)

    def check_health(self) -> None:
        """EngineCoreDiedError once the core process is gone (it checks its own workers)."""
        if not self._client.is_alive():
            raise EngineCoreDiedError(self._client.death or "the engine core is gone")

    def shutdown(self) -> None:
        self._client.close()

    def drain_block_alloc_seconds(self) -> list[float]:
        out, self.alloc_seconds = self.alloc_seconds, []
        return out

    def drain_restore_seconds(self) -> list[float]:
        out, self.restore_seconds = self.restore_seconds, []
        return out

