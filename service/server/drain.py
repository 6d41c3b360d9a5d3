"""uvicorn that drains the engine on SIGTERM/SIGINT before it stops (the signal protocol is
service/signal_drain.py's)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvicorn

from kvserve.engine.async_engine import AsyncEngine
from kvserve.service.signal_drain import SignalDrainServer

logger = logging.getLogger("kvserve.service.api_server")


class DrainingServer(SignalDrainServer):
    """uvicorn that, on SIGTERM/SIGINT, first drains the engine (new requests get 503, running
    ones finish within the grace period), then stops. A second signal exits at once."""

    logger = logger

    @classmethod
    def for_app(cls, app: Any, host: str, port: int, log_level: str) -> DrainingServer:
        """The server of an app from service/server/app.py (its engine and grace period)."""
        grace = app.state.config.shutdown_grace_period
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=max(int(grace), 1))
        return cls(config, app.state.engine, grace, getattr(app.state, "drain_hooks", []))

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float,
                 drain_hooks: Sequence[Callable[[], Awaitable[None]]] = ()) -> None:
        super().__init__(config, grace)
        self.engine = engine
        self.drain_hooks = list(drain_hooks)  # run first (stop advertising in the index)

    async def drain(self) -> None:
        *_, aborted = await asyncio.gather(*(hook() for hook in self.drain_hooks),
                                           self.engine.shutdown(self.grace))
        logger.info("drained (%d request(s) aborted); stopping", aborted)
