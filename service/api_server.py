"""`python -m kvserve.service.api_server`: one replica's process, with the flags of `kvserve serve`.

It loads the model, prints the memory budget, starts publishing to the prefix index when asked,
and serves the app (service/server/app.py) until SIGTERM/SIGINT, then drains.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvserve.engine.engine_core import engine_core_mode
from kvserve.engine.engine_core.core_client import CoreClient
from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.drain import DrainingServer
from kvserve.service.serve_args import (build_serve_parser, engine_config_from_args,
                                        server_config_from_args, setup_logging)
from kvserve.service.server.publishing import make_publisher, replica_role

logger = logging.getLogger("kvserve.service.api_server")
# Seconds between the engine core's death and the server's exit: open streams send their error
# event, /health answers 503 with the reason.
EXIT_AFTER_CORE_DEATH_S = float(os.environ.get("KVSERVE_EXIT_AFTER_CORE_DEATH_S", "1.0"))


def run_server(engine_config: Any, config: ServerConfig) -> int:
    """Load the model, print the memory budget, serve until SIGTERM/SIGINT (then drain)."""
    from kvserve.engine.llm_engine import LLMEngine

    if config.additional_models:  # several models, one shared KV pool, one process
        return run_multi_server(engine_config, config)
    # The server is a guarded entry point: its tensor-parallel workers spawn, as they did before
    # scripts could fork them, so no lock held by a server thread is ever inherited by a worker.
    os.environ.setdefault("KVSERVE_WORKER_MULTIPROC_METHOD", "spawn")
    if engine_core_mode(config.engine_core) == "process":  # and its TP workers
        engine: Any = CoreClient(engine_config)
        info: Any = engine.info
    else:
        engine = info = LLMEngine.from_config(engine_config)
    logger.info("memory budget: %s", info.memory_budget.describe())
    model = (config.served_model_names or [info.model_name])[0]
    # The router's adapter affinity: each heartbeat carries the adapters this replica holds now
    # (`app` is bound below, before the publisher's first heartbeat).
    adapters = ((lambda: app.state.engine.resident_loras())
                if getattr(info.config, "enable_lora", False) else None)
    publisher = make_publisher(config, model, info.block_size, adapters=adapters,
                               role=replica_role(getattr(engine_config, "kv_transfer_config",
                                                         None)))
    app = create_app(engine, config, publisher)
    server = DrainingServer.for_app(app, config.host, config.port, config.log_level.lower())
    died: list[BaseException] = []
    if isinstance(engine, CoreClient):
        app.state.engine.on_dead.append(lambda exc: _exit_soon(server, died, exc))
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", config.host, config.port)
    try:
        server.run()
    finally:
        (engine.close if isinstance(engine, CoreClient) else engine.shutdown)()
    return 1 if died else 0


def run_multi_server(engine_config: Any, config: ServerConfig) -> int:
    """`--additional-model`: every model in this process over one KV pool, one port."""
    import uvicorn

    from kvserve.service.server.multi_model import AllEngines, multi_model_app

    app, apps = multi_model_app(engine_config, config)
    grace = config.shutdown_grace_period
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=config.log_level.lower(),
                                           timeout_graceful_shutdown=max(int(grace), 1)),
                            AllEngines(apps), grace)  # type: ignore[arg-type]
    logger.info("listening on http://%s:%d (OpenAI API under /v1): models %s", config.host,
                config.port, ", ".join(apps.models.engines))
    try:
        server.run()
    finally:
        apps.models.shutdown()
    return 0


def _exit_soon(server: Any, died: list[BaseException], exc: BaseException) -> None:
    """The engine core died: open streams got their error event; stop serving a moment later
    so the pod restarts (/health answers 503 with the reason until then)."""
    died.append(exc)

    def stop() -> None:
        server.should_exit = True

    threading.Timer(EXIT_AFTER_CORE_DEATH_S, stop).start()


def serve(args: argparse.Namespace) -> int:
    """`kvserve serve` and this module's own entry point: the parsed serve flags, served
    (`--headless`: this worker host's ranks of a multi-host replica, no API server)."""
    setup_logging(args.log_level)
    engine_config = engine_config_from_args(args)
    if getattr(args, "headless", False):
        return run_headless_host(engine_config)
    return run_server(engine_config, server_config_from_args(args))


def run_headless_host(engine_config: Any) -> int:
    """Run this host's ranks until the leader stops them (0) or one of them fails (1)."""
    from kvserve.engine.worker.rank_env import from_environ
    from kvserve.engine.worker.headless import run_headless

    env = from_environ()
    if not env.multi_node:
        from kvserve.engine.errors import ConfigError

        raise ConfigError("--headless needs a multi-host group in the environment: "
                          "LWS_GROUP_SIZE + LWS_WORKER_INDEX + LWS_LEADER_ADDRESS (a "
                          "LeaderWorkerSet sets them) or MASTER_ADDR + RANK + WORLD_SIZE")
    return run_headless(engine_config.world_size, env)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvserve.service.api_server`: the flags of `kvserve serve`."""
    parser = build_serve_parser(prog="python -m kvserve.service.api_server")
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
