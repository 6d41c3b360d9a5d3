"""POST /reset_prefix_cache: vLLM's development endpoint that forgets every cached prefix block
(device, host and disk tiers). As in vLLM, it exists only with VLLM_SERVER_DEV_MODE=1 (or
KVSERVE_SERVER_DEV_MODE=1): anyone who can reach it can wipe the cache."""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Query
from fastapi.responses import Response

from kvserve.service.server.context import ServingContext

DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "KVSERVE_SERVER_DEV_MODE")
logger = logging.getLogger("kvserve.service.api_server")


def dev_mode() -> bool:
    """vLLM's `bool(int(VLLM_SERVER_DEV_MODE))`, with true/yes accepted too."""
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes") for k in DEV_MODE_ENV)


def add_prefix_cache_route(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(default=False),
                                 reset_external: bool = Query(default=False)) -> Response:
        """Forget the prefix cache (vLLM's dev endpoint; 200 whether or not running requests
        kept it from resetting, as vLLM's). `reset_external` is accepted: the host and disk
        tiers, this server's only external cache, are always reset with it."""
        logger.info("Resetting prefix cache...")
        # the engine thread (or the engine core process) runs it between steps
        await ctx.engine._call("reset_prefix_cache", reset_running_requests)  # noqa: SLF001
        return Response(status_code=200)
