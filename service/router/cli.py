"""`kvserve router` and `python -m kvserve.service.router`: flags, RouterConfig, uvicorn.

The router serves the OpenAI API on one port in front of many `kvserve serve` replicas, which it
finds through Redis heartbeats (`--redis-url`) or a static `--replicas url,url`."""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from kvserve.service.flags import LOG_LEVELS, REDIS_URL_FORMS, add_limit_args, limits_from_args
from kvserve.service.prefix_index.keys import IndexKeys
from kvserve.service.prefix_index.redis_client import parse_redis_url, redact_url
from kvserve.service.prefix_index.replica_info import REGISTRATION_TOKEN_ENV
from kvserve.service.router.app import create_app
from kvserve.service.router.config import RouterConfig
from kvserve.service.router.drain import DrainingRouterServer
from kvserve.service.router.pd import PDConfig
from kvserve.service.routing_policy import POLICIES, PolicyConfig

logger = logging.getLogger("kvserve.router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterConfig()
    pc = d.policy_cfg
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--redis-url", default=None,
                   help="Redis holding the prefix index and replica heartbeats: " + REDIS_URL_FORMS)
    p.add_argument("--service-name", default=d.service_name,
                   help="index namespace (keys kvserve:<service>:...), as on the replicas")
    p.add_argument("--replicas", default="",
                   help="comma-separated replica URLs: the set without Redis, the fallback with it")
    p.add_argument("--policy", choices=POLICIES, default=d.policy,
                   help="prefix: replica holding the longest prompt prefix, unless overloaded; "
                        "pd: prefill/decode disaggregation (decode replica by prefix, long "
                        "uncached prompts prefilled on a prefill replica)")
    p.add_argument("--pd-threshold", type=int, default=d.pd.threshold,
                   help="--policy pd: uncached prompt tokens (prompt minus the decode replica's "
                        "cached prefix) above which a prefill replica does the prefill")
    p.add_argument("--pd-max-prefill-queue", type=int, default=d.pd.max_prefill_queue,
                   help="--policy pd: a prefill replica with more requests running + waiting "
                        "is not used; when all have more, the decode replica prefills locally")
    p.add_argument("--pd-prefill-timeout", type=float, default=d.pd.prefill_timeout,
                   help="--policy pd: seconds a prefill replica gets to answer before the "
                        "decode replica prefills locally")
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
    p.add_argument("--host-weight", type=float, default=pc.host_weight,
                   help="worth of a prefix block held only in a replica's host-memory tier, as a "
                        "fraction of a device block (0..1): a device hit ranks above a host hit")
    p.add_argument("--overload-factor", type=float, default=pc.overload_factor,
                   help="skip replicas with load > factor * mean + slack")
    p.add_argument("--overload-slack", type=int, default=pc.overload_slack,
                   help="requests added to factor * mean load before a replica counts as "
                        "overloaded (small loads never do)")
    p.add_argument("--shared-load-interval", type=float, default=d.shared_load_interval,
                   help="seconds between exchanges of in-flight counts with the service's other "
                        "routers through Redis (several routers must not herd on stale loads); "
                        "0 turns it off")
    p.add_argument("--down-cooldown", type=float, default=d.down_cooldown,
                   help="seconds a replica that failed (or hung) stays out of routing")
    p.add_argument("--upstream-connect-timeout", type=float, default=d.connect_timeout,
                   help="seconds a replica gets to accept a connection before the next is tried")
    p.add_argument("--upstream-first-byte-timeout", type=float, default=d.first_byte_timeout,
                   help="seconds without a first byte after which the router checks the "
                        "replica's /health (same limit); no answer: hung, try the next replica")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (env KVSERVE_API_KEY); /health and "
                        "/metrics stay open")
    p.add_argument("--expose-routing-headers", action="store_true",
                   help="add x-kvserve-replica, x-kvserve-predicted-matched-tokens and "
                        "x-kvserve-predicted-host-tokens to responses (they reveal what other "
                        "requests have cached)")
    p.add_argument("--heartbeat-max-age", type=float, default=d.heartbeat_max_age,
                   help="with KVSERVE_REGISTRATION_TOKEN: seconds a signed heartbeat's timestamp "
                        "may be off from this router's clock (older: a replay, left out)")
    p.add_argument("--shutdown-grace-period", type=float, default=d.shutdown_grace_period,
                   help="seconds requests in flight get to finish after SIGTERM")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                   metavar="NAME=PATH",
                   help="LoRA adapters the router may have replicas load: NAME=PATH (or vLLM's "
                        "JSON form '{\"name\": ..., \"path\": ...}'), PATH as the replicas see "
                        "it; a request whose `model` is NAME goes to a replica holding it, and "
                        "when none does the least-loaded one is asked to load it "
                        "(POST /v1/load_lora_adapter; replicas need --enable-lora and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true). Repeatable")
    p.add_argument("--lora-spread-slack", type=int, default=pc.lora_spread_slack,
                   help="a LoRA adapter whose least-busy holder has more than this many requests "
                        "above the least-loaded replica is loaded on that replica too (0: only "
                        "when its holders are overloaded)")
    p.add_argument("--lora-load-timeout", type=float, default=d.lora_load_timeout,
                   help="seconds a replica gets to load a LoRA adapter the router asked for")
    p.add_argument("--migration-limit", type=int, default=d.migration_limit,
                   help="times one streamed completion or chat request may move to another "
                        "replica when its replica dies or drains mid-stream (it goes on there as a "
                        "continuation of the tokens delivered); past it the stream ends with an "
                        "error event. 0 turns migration off")
    p.add_argument("--migration-max-tokens", type=int, default=d.migration_max_tokens,
                   help="do not migrate a stream longer than this many tokens (prompt + "
                        "delivered): its re-prefill would cost more than a retry; 0 = no limit")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="log level of the router and uvicorn")
    add_limit_args(p)


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    if ns.redis_url:
        try:
            parse_redis_url(ns.redis_url)
            IndexKeys(ns.service_name)
        except ValueError as exc:
            raise SystemExit(f"kvserve router: {exc}") from None
    replicas = tuple(u.strip() for u in ns.replicas.split(",") if u.strip())
    pc = PolicyConfig(load_weight=ns.load_weight, overload_factor=ns.overload_factor,
                      overload_slack=ns.overload_slack, min_match_tokens=ns.min_match_tokens,
                      host_weight=_fraction(ns.host_weight, "--host-weight"),
                      lora_spread_slack=max(ns.lora_spread_slack, 0))
    return RouterConfig(host=ns.host, port=ns.port, redis_url=ns.redis_url,
                        service_name=ns.service_name, replicas=replicas, policy=ns.policy,
                        tokenizer=ns.tokenizer, session_header=ns.session_header.lower(),
                        policy_cfg=pc, pd=_pd_config(ns), block_size=ns.block_size,
                        down_cooldown=ns.down_cooldown,
                        connect_timeout=_positive(ns.upstream_connect_timeout,
                                                  "--upstream-connect-timeout"),
                        first_byte_timeout=_positive(ns.upstream_first_byte_timeout,
                                                     "--upstream-first-byte-timeout"),
                        max_body_bytes=ns.max_body_bytes, limits=limits_from_args(ns),
                        api_key=ns.api_key or os.environ.get("KVSERVE_API_KEY") or None,
                        expose_routing_headers=ns.expose_routing_headers,
                        registration_token=os.environ.get(REGISTRATION_TOKEN_ENV) or None,
                        heartbeat_max_age=_positive(ns.heartbeat_max_age, "--heartbeat-max-age"),
                        shutdown_grace_period=max(ns.shutdown_grace_period, 0.0),
                        shared_load_interval=_non_negative(ns.shared_load_interval,
                                                           "--shared-load-interval"),
                        lora_modules=parse_lora_modules(ns.lora_modules),
                        lora_load_timeout=_positive(ns.lora_load_timeout, "--lora-load-timeout"),
                        migration_limit=max(ns.migration_limit, 0),
                        migration_max_tokens=max(ns.migration_max_tokens, 0))


def parse_lora_modules(items: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """--lora-modules values (NAME=PATH or vLLM's JSON object) as (name, path) pairs; SystemExit
    naming the bad one."""
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path = obj["name"], obj["path"]
            except (ValueError, KeyError, TypeError):
                raise SystemExit(f"kvserve router: --lora-modules {item!r}: the JSON form needs "
                                 '"name" and "path"') from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise SystemExit(f"kvserve router: --lora-modules {item!r}: write NAME=PATH")
        if not isinstance(name, str) or not isinstance(path, str) or not name.strip() \
                or not path.strip():
            raise SystemExit(f"kvserve router: --lora-modules {item!r}: the name and the path "
                             "must not be empty")
        if name in out:
            raise SystemExit(f"kvserve router: --lora-modules names adapter {name!r} twice")
        out[name.strip()] = path.strip()
    return tuple(out.items())


def _pd_config(ns: argparse.Namespace) -> PDConfig:
    try:
        return PDConfig(threshold=ns.pd_threshold, max_prefill_queue=ns.pd_max_prefill_queue,
                        prefill_timeout=ns.pd_prefill_timeout)
    except ValueError as exc:
        raise SystemExit(f"kvserve router: {exc}") from None


def _positive(value: float, flag: str) -> float:
    if not value > 0:
        raise SystemExit(f"kvserve router: {flag} must be a positive number of seconds")
    return value


def _non_negative(value: float, flag: str) -> float:
    if not value >= 0:
        raise SystemExit(f"kvserve router: {flag} must be 0 or a positive number of seconds")
    return value


def _fraction(value: float, flag: str) -> float:
    if not 0.0 <= value <= 1.0:
        raise SystemExit(f"kvserve router: {flag} must be between 0 and 1, got {value}")
    return value


def run_from_args(ns: argparse.Namespace) -> None:
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per proxied request
    cfg = config_from_args(ns)
    if not cfg.redis_url and not cfg.replicas:
        raise SystemExit("kvserve router: pass --redis-url and/or --replicas url,url")
    logger.info("router on http://%s:%d policy=%s redis=%s static=%s auth=%s registration=%s",
                cfg.host, cfg.port, cfg.policy, redact_url(cfg.redis_url),
                ",".join(cfg.replicas) or "-", "on" if cfg.api_key else "off",
                "signed replicas only" if cfg.registration_token else "any replica")
    server_for(create_app(cfg), log_level=ns.log_level.lower()).run()


def server_for(app: Any, log_level: str = "info") -> DrainingRouterServer:
    """The uvicorn server of a router app, draining on SIGTERM within its grace period."""
    import uvicorn

    cfg: RouterConfig = app.state.config
    # Requests still running when the grace period is over are cut after one more second.
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level,
                            access_log=False, timeout_graceful_shutdown=1)
    return DrainingRouterServer(config, app.state.drain, cfg.shutdown_grace_period)


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
