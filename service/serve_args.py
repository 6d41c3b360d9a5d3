"""`kvserve serve`'s flags and what they become: the parser (engine, server and limit flags from
service/flags.py) and the EngineConfig and ServerConfig it yields. Below both the CLI
(service/cli.py) and the server process it starts (service/api_server.py)."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import fields
from typing import Any

from kvserve.engine.config import DEFAULT_MODEL, EngineConfig, structured_outputs_backend
from kvserve.engine.errors import ConfigError
from kvserve.service.flags import add_engine_args, add_server_args, limits_from_args
from kvserve.service.tool_parsers import TOOL_PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"model to serve (same as --model; default {DEFAULT_MODEL})")
    add_engine_args(parser)
    add_server_args(parser)


def build_serve_parser(prog: str = "kvserve serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=SERVE_DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(parser)
    return parser


SERVE_DESCRIPTION = ("Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, "
                     "/v1/models) with Prometheus metrics on /metrics.")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from parsed flags (dashes become underscores); ConfigError if invalid."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    values["model"] = args.model_tag or args.model or DEFAULT_MODEL
    values["served_model_name"] = args.served_model_name[0] if args.served_model_name else None
    if getattr(args, "structured_outputs_config", None) is not None:
        default = EngineConfig.structured_outputs_backend
        flag = values.get("structured_outputs_backend")
        values["structured_outputs_backend"] = structured_outputs_backend(
            args.structured_outputs_config, None if flag == default else flag) or flag
    return EngineConfig.from_kwargs(**values)


def server_config_from_args(args: argparse.Namespace) -> Any:
    from kvserve.service.server.config import ServerConfig

    if args.redis_url:
        check_redis_url(args.redis_url, args.service_name)
    return ServerConfig(
        host=args.host, port=args.port, served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or os.environ.get("KVSERVE_API_KEY") or None,
        public_paths=tuple(args.public_paths),
        max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_time_limit=args.chat_template_time_limit,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        **tool_options(args),
        limits=limits_from_args(args),
        allowed_origins=list(args.allowed_origins),
        shutdown_grace_period=args.shutdown_grace_period, log_level=args.log_level,
        engine_core=args.engine_core, redis_url=args.redis_url, service_name=args.service_name,
        advertise_url=args.advertise_url, replica_id=args.replica_id, print_banner=True,
        lora_modules=_lora_modules(args),
        additional_models=list(getattr(args, "additional_model", None) or []))


def _lora_modules(args: argparse.Namespace) -> list[Any]:
    modules = list(getattr(args, "lora_modules", None) or [])
    if modules and not getattr(args, "enable_lora", False):
        raise ConfigError("--lora-modules needs --enable-lora")
    return modules


def tool_options(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template, --enable-auto-tool-choice, --tool-call-parser and --reasoning-parser as
    ServerConfig fields; ConfigError for a combination vLLM refuses, or one we do not support."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                          f"{', '.join(sorted(TOOL_PARSERS))})")
    out: dict[str, Any] = {"chat_template": args.chat_template,
                           "enable_auto_tool_choice": args.enable_auto_tool_choice,
                           "reasoning_parser": getattr(args, "reasoning_parser", None)}
    if args.tool_call_parser:
        out["tool_call_parser"] = args.tool_call_parser
    return out


def check_redis_url(url: str, service_name: str = "default") -> None:
    """ConfigError (before the model loads) for a --redis-url (or --service-name) that cannot
    work."""
    try:
        from kvserve.service.prefix_index.keys import IndexKeys
        from kvserve.service.prefix_index.redis_client import parse_redis_url
    except ModuleNotFoundError:  # without the prefix index the server warns and goes on
        return
    try:
        parse_redis_url(url)
        IndexKeys(service_name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
