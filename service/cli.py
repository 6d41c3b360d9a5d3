"""`kvserve` command line: `serve`, `fetch-model`, plus `router`, `epp`, `plan`, `render` and
`operator` from their modules. The flags themselves are in service/flags.py."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from kvserve.engine.config import DEFAULT_MODEL
from kvserve.engine.errors import ConfigError, KVServeError
from kvserve.service.serve_args import (SERVE_DESCRIPTION, add_serve_args, build_serve_parser,
                                        engine_config_from_args, server_config_from_args,
                                        setup_logging)

logger = logging.getLogger("kvserve.cli")
# The serve flags' parser and configs, used from here by tests and docs/gen.
__all__ = ["build_parser", "build_serve_parser", "engine_config_from_args", "main",
           "server_config_from_args"]

# Modules that add their own subcommands with `register(subparsers)`, if installed.
EXTERNAL_COMMANDS = ("kvserve.service.router.cli", "kvserve.service.epp.cli",
                     "kvserve.operator.cli")


def run_serve(args: argparse.Namespace) -> int:
    from kvserve.service.api_server import serve

    return serve(args)


def run_fetch_model(args: argparse.Namespace) -> int:
    setup_logging("info")
    from kvserve.engine.worker.model_loader import fetch_model

    print(fetch_model(args.name))
    return 0


def register_external(subparsers: Any, module_name: str) -> bool:
    """Let `module_name` add its subcommands; skip (with a warning) only if it does not exist."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        logger.warning("%s is not installed: its subcommands are not available", module_name)
        return False
    module.register(subparsers)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: a paged KV-cache LLM engine, an OpenAI-compatible "
        "server, a prefix-aware router and a Kubernetes operator.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API",
                           description=SERVE_DESCRIPTION,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_serve)
    fetch = sub.add_parser("fetch-model", help="download a known model once; print its folder",
                           description="Download and convert a known model into the kvserve "
                           "cache (once) and print the folder.")
    fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                       help=f"known model name (default {DEFAULT_MODEL})")
    fetch.set_defaults(func=run_fetch_model)
    for module_name in EXTERNAL_COMMANDS:
        register_external(sub, module_name)
    return parser


def _version() -> str:
    import kvserve

    return f"kvserve {kvserve.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"kvserve: configuration error: {exc}", file=sys.stderr)
        return 2
    except KVServeError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
