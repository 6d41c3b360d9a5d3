"""`python -m kvserve.service.api_server`: one replica's process, with the flags of `kvserve serve`.

It loads the model, prints the memory budget, starts publishing to the prefix index when asked,
and serves the app (service/server/app.py) until SIGTERM/SIGINT, then drains.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvserve.service.server.app import create_app
from kvserve.service.server.config import ServerConfig
from kvserve.service.server.drain import DrainingServer
from kvserve.service.server.publishing import make_publisher

logger = logging.getLogger("kvserve.service.api_server")


def run_server(engine_config: Any, config: ServerConfig) -> int:
    """Load the model, print the memory budget, serve until SIGTERM/SIGINT (then drain)."""
    from kvserve.engine.llm_engine import LLMEngine

    # The server is a guarded entry point: its tensor-parallel workers spawn, as they did before
    # scripts could fork them, so no lock held by a server thread is ever inherited by a worker.
    os.environ.setdefault("KVSERVE_WORKER_MULTIPROC_METHOD", "spawn")
    llm_engine = LLMEngine.from_config(engine_config)
    logger.info("memory budget: %s", llm_engine.memory_budget.describe())
    model = (config.served_model_names or [llm_engine.model_name])[0]
    publisher = make_publisher(config, model, llm_engine.block_size)
    app = create_app(llm_engine, config, publisher)
    server = DrainingServer.for_app(app, config.host, config.port, config.log_level.lower())
    logger.info("listening on http://%s:%d (OpenAI API under /v1)", config.host, config.port)
    try:
        server.run()
    finally:
        llm_engine.shutdown()  # tensor-parallel workers go with the server
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvserve.service.api_server`: the flags of `kvserve serve`."""
    from kvserve.service import cli

    parser = cli.build_serve_parser(prog="python -m kvserve.service.api_server")
    return cli.run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
