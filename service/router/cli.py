"""`kvserve router` and `python -m kvserve.service.router`: flags, RouterConfig, uvicorn.

The router serves the OpenAI API on one port in front of many `kvserve serve` replicas, which it
finds through Redis heartbeats (`--redis-url`) or a static `--replicas url,url`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from kvserve.service.cli import add_limit_args, limits_from_args
from kvserve.service.router.app import create_app
from kvserve.service.router.config import RouterConfig
from kvserve.service.routing_policy import POLICIES, PolicyConfig

logger = logging.getLogger("kvserve.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    pc = d.policy_cfg
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--redis-url", default=None,
                   help="Redis holding the prefix index and replica heartbeats")
    p.add_argument("--service-name", default=d.service_name,
                   help="index namespace (keys kvserve:<service>:...), as on the replicas")
    p.add_argument("--replicas", default="",
                   help="comma-separated replica URLs: the set without Redis, the fallback with it")
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="prefix: replica holding the longest prompt prefix, unless overloaded")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer path or model name (default: the model the replicas announce)")
    p.add_argument("--session-header", default=d.session_header,
                   help="header hashed by the session policy (falls back to the body's `user`)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="block size of static replicas (Redis replicas announce theirs)")
    p.add_argument("--min-match-tokens", type=int, default=pc.min_match_tokens,
                   help="predicted cache hit needed before prefix beats least load")
    p.add_argument("--load-weight", type=float, default=pc.load_weight,
                   help="score = matched fraction - load_weight * load / max load")
    p.add_argument("--overload-factor", type=float, default=pc.overload_factor,
                   help="skip replicas with load > factor * mean + slack")
    p.add_argument("--overload-slack", type=int, default=pc.overload_slack)
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown,
                   help="seconds a replica that failed stays out of routing")
    p.add_argument("--log-level", default="info",
                   choices=("debug", "info", "warning", "error", "critical"))
    add_limit_args(p)


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    replicas = tuple(u.strip() for u in ns.replicas.split(",") if u.strip())
    pc = PolicyConfig(load_weight=ns.load_weight, overload_factor=ns.overload_factor,
                      overload_slack=ns.overload_slack, min_match_tokens=ns.min_match_tokens)
    return RouterConfig(host=ns.host, port=ns.port, redis_url=ns.redis_url,
                        service_name=ns.service_name, replicas=replicas, policy=ns.policy,
                        tokenizer=ns.tokenizer, session_header=ns.session_header.lower(),
                        policy_cfg=pc, block_size=ns.block_size, down_cooldown=ns.down_cooldown,
                        max_body_bytes=ns.max_body_bytes, limits=limits_from_args(ns))


def run_from_args(ns: argparse.Namespace) -> None:
    import uvicorn

    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request
    cfg = config_from_args(ns)
    if not cfg.redis_url and not cfg.replicas:
        raise SystemExit("kvserve router: pass --redis-url and/or --replicas url,url")
    logger.info("router on http://%s:%d policy=%s redis=%s static=%s", cfg.host, cfg.port,
                cfg.policy, cfg.redis_url, ",".join(cfg.replicas) or "-")
    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level=ns.log_level.lower(),
                access_log=False)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `kvserve router` to the CLI's subparsers; the handler is `args.func(args)`."""
    p = subparsers.add_parser(
        "router", help="prefix-aware router in front of kvserve replicas",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="OpenAI-compatible router: sends each request to the replica that already "
                    "holds its prompt prefix (Redis index), unless that replica is overloaded.")
    add_arguments(p)
    p.set_defaults(func=run_from_args)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.service.router",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))
