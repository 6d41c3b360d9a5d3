"""uvicorn that drains on SIGTERM/SIGINT before it stops: the one signal protocol of the server and
the router (service/server/drain.py, service/router/drain.py), which differ only in what draining
means. The first signal starts `drain()` on the serving loop; a second one exits at once, as a
user pressing Ctrl-C twice expects. A signal before the server serves has nothing to drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import uvicorn


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

    async def drain(self) -> None:
        """Stop taking work and wait (at most `grace` seconds) for the work in flight."""
        raise NotImplementedError

    def stop_accepting(self) -> str:
        """Called in the first signal's handler: stop taking new work at once (a subclass's), and
        say what is being drained, for the log line."""
        return "draining"

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
        elif self.drain_requested:  # a second signal: stop now
            self.logger.warning("second signal: exiting without waiting for work in flight")
            self.should_exit = self.force_exit = True
        else:
            self.drain_requested = True
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
