"""uvicorn that drains the engine on SIGTERM/SIGINT before it stops."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvicorn

from kvserve.engine.async_engine import AsyncEngine

logger = logging.getLogger("kvserve.service.api_server")


class DrainingServer(uvicorn.Server):
    """uvicorn that, on SIGTERM/SIGINT, first drains the engine (new requests get 503, running
    ones finish within the grace period), then stops. A second signal exits at once."""

    @classmethod
    def for_app(cls, app: Any, host: str, port: int, log_level: str) -> DrainingServer:
        """The server of an app from service/server/app.py (its engine and grace period)."""
        grace = app.state.config.shutdown_grace_period
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=max(int(grace), 1))
        return cls(config, app.state.engine, grace, getattr(app.state, "drain_hooks", []))

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float,
                 drain_hooks: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace
        self.drain_hooks = list(drain_hooks)  # run first (stop advertising in the index)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._drain_requested = False

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
        elif self._drain_requested:  # a second signal: stop now
            logger.warning("second signal: exiting without waiting for running requests")
            self.should_exit = self.force_exit = True
        else:
            self._drain_requested = True
            logger.info("signal %s: draining (grace period %.0f s)", signal.Signals(sig).name,
                        self.grace)
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        *_, aborted = await asyncio.gather(*(hook() for hook in self.drain_hooks),
                                           self.engine.shutdown(self.grace))
        logger.info("drained (%d request(s) aborted); stopping", aborted)
        self.should_exit = True

