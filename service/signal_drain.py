"""uvicorn that drains on SIGTERM/SIGINT before it stops: the one signal protocol of the server and
the router (service/server/drain.py, service/router/drain.py), which differ only in what draining
means. The first signal starts `drain()` on the serving loop; a second one exits at once, as a
user pressing Ctrl-C twice expects. A signal before the server serves has nothing to drain.
Run as a process (`run()` in the main thread), the exit is bounded: a watchdog ends the process
`grace + SHUTDOWN_MARGIN_S` after the first signal, `FORCED_EXIT_S` after the second (issue 41)."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

import uvicorn

# Beyond the grace period, what a shutdown may take (the engine core's stop, the lifespan's
# closes) before the watchdog ends the process; after a second signal, the whole budget.
SHUTDOWN_MARGIN_S = float(os.environ.get("KVSERVE_SHUTDOWN_MARGIN_S", "30"))
FORCED_EXIT_S = float(os.environ.get("KVSERVE_FORCED_EXIT_S", "10"))


class SignalDrainServer(uvicorn.Server):
    """A uvicorn.Server whose first exit signal runs `drain()` (a subclass's) and only then sets
    `should_exit`; the second sets `force_exit` too."""

    logger = logging.getLogger("kvserve.service")

    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self.drain_requested = False
        self.watchdog: ExitWatchdog | None = None  # armed by run() in a process's main thread

    async def drain(self) -> None:
        """Stop taking work and wait (at most `grace` seconds) for the work in flight."""
        raise NotImplementedError

    def stop_accepting(self) -> str:
        """Called in the first signal's handler: stop taking new work at once (a subclass's), and
        say what is being drained, for the log line."""
        return "draining"

    def run(self, sockets: list | None = None) -> None:
        if threading.current_thread() is threading.main_thread():  # a process, not a test thread
            self.watchdog = ExitWatchdog(self.logger)
        super().run(sockets)

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            self._arm(self.grace + SHUTDOWN_MARGIN_S)
        elif self.drain_requested:  # a second signal: stop now
            self.logger.warning("second signal: exiting without waiting for work in flight")
            self.should_exit = self.force_exit = True
            self._arm(FORCED_EXIT_S)
        else:
            self.drain_requested = True
            self._arm(self.grace + SHUTDOWN_MARGIN_S)
            self.logger.info("signal %s: %s (grace period %.0f s)", signal.Signals(sig).name,
                             self.stop_accepting(), self.grace)
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True

    def _arm(self, seconds: float) -> None:
        if self.watchdog is not None:
            self.watchdog.exit_within(seconds)


class ExitWatchdog:
    """Ends the process at a deadline: a shutdown that hangs (a ZMQ term, a task that swallows
    its cancellation, a peer that never answers) must not keep a pod Terminating until the
    kubelet's SIGKILL. It prints every thread's stack first, so the hang can be fixed."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._deadline: float | None = None
        self._changed = threading.Event()
        self._thread: threading.Thread | None = None

    def exit_within(self, seconds: float) -> None:
        """Exit at most `seconds` from now (an earlier deadline already set stays)."""
        deadline = time.monotonic() + seconds
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline
            self._changed.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvserve-exit-watchdog",
                                            daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            assert self._deadline is not None
            self._changed.clear()
            left = self._deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.wait(left)
        self.log.error("shutdown did not end in time: exiting now (threads' stacks follow)")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for child in multiprocessing.active_children():  # the engine core and its workers
            child.kill()
        logging.shutdown()
        os._exit(3)
