"""`kvserve epp`: the Endpoint Picker's flags. The scoring flags are the router's own
(service/router/cli.py), taken from its parser, and become the same RouterConfig."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from kvserve.service.epp.config import EppConfig
from kvserve.service.epp.endpoints import EndpointError, parse_endpoints
from kvserve.service.epp.objectives import ObjectivesError, Saturation, load_objectives
from kvserve.service.router import cli as router_cli

# The router flags that mean the same for the EPP: discovery (Redis), scoring, LoRA, logging.
ROUTER_FLAGS = ("redis_url", "service_name", "policy", "tokenizer", "session_header",
                "block_size", "min_match_tokens", "load_weight", "host_weight",
                "overload_factor", "overload_slack", "shared_load_interval", "down_cooldown",
                "heartbeat_max_age", "lora_modules", "lora_spread_slack", "lora_load_timeout",
                "log_level", "pd_threshold", "pd_max_prefill_queue")


def _router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    router_cli.add_arguments(parser)
    return parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EppConfig()
    p.add_argument("--host", default=d.host, help="address the gRPC and metrics ports bind")
    p.add_argument("--grpc-port", type=int, default=d.grpc_port,
                   help="ext_proc gRPC port (envoy.service.ext_proc.v3.ExternalProcessor)")
    p.add_argument("--grpc-health-port", type=int, default=d.grpc_health_port,
                   help="gRPC health port (liveness, readiness, the ext_proc service); 0: off")
    p.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="Prometheus /metrics port; 0: off")
    p.add_argument("--endpoints", default="",
                   help="static endpoints host:port,host:port (with --redis-url: the fallback)")
    p.add_argument("--pool-name", default=None,
                   help="InferencePool (inference.networking.k8s.io/v1) whose Ready pods are "
                        "the endpoints (with --redis-url: scored with the prefix index)")
    p.add_argument("--pool-namespace", default=d.pool_namespace,
                   help="namespace of --pool-name")
    p.add_argument("--secure-serving", action="store_true",
                   help="serve the ext_proc port over TLS with a self-signed certificate "
                        "(the --grpc-health-port stays plaintext for kubelet probes)")
    p.add_argument("--fallback-list", action="store_true",
                   help="send every eligible endpoint, best first (ip:port,ip:port), for "
                        "gateways that retry down the list; Envoy's ORIGINAL_DST takes one")
    p.add_argument("--objectives", default=None, metavar="FILE",
                   help="YAML/JSON objectives, {name: priority} or InferenceObjective objects: "
                        "a negative priority is shed (429) when the pool is saturated")
    p.add_argument("--saturation-queue-depth", type=int, default=d.saturation.queue_depth,
                   help="a replica with this many requests (running + waiting) is saturated")
    p.add_argument("--saturation-kv-usage", type=float, default=d.saturation.kv_usage,
                   help="a replica whose KV cache is this full (0..1) is saturated")
    p.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                   help="event loop: auto = uvloop when installed (less CPU per ext_proc "
                        "message, docs/perf/epp.md), else asyncio")
    group = p.add_argument_group("scoring and discovery (the same flags as `kvserve router`)")
    for action in _router_parser()._actions:
        if action.dest in ROUTER_FLAGS:
            # What argparse's `parents=` does, for a chosen subset of the router's flags.
            group._add_action(action)


def config_from_args(ns: argparse.Namespace) -> EppConfig:
    """EppConfig from parsed flags; SystemExit with a message for a bad combination."""
    router_ns = _router_parser().parse_args([])
    for name in ROUTER_FLAGS:
        setattr(router_ns, name, getattr(ns, name))
    try:
        endpoints = parse_endpoints(ns.endpoints)
        objectives = load_objectives(ns.objectives)
        saturation = Saturation(ns.saturation_queue_depth, ns.saturation_kv_usage)
    except (EndpointError, ObjectivesError) as exc:
        raise SystemExit(f"kvserve epp: {exc}") from None
    if not endpoints and not ns.redis_url and not ns.pool_name:
        raise SystemExit("kvserve epp: pass --endpoints host:port,..., --redis-url (with "
                         "--service-name) or --pool-name (with --pool-namespace)")
    return EppConfig(host=ns.host, grpc_port=ns.grpc_port, grpc_health_port=ns.grpc_health_port,
                     metrics_port=ns.metrics_port, endpoints=endpoints, pool_name=ns.pool_name,
                     pool_namespace=ns.pool_namespace, secure_serving=ns.secure_serving,
                     fallback_list=ns.fallback_list, objectives=objectives,
                     saturation=saturation, router=router_cli.config_from_args(router_ns))


def run_from_args(ns: argparse.Namespace) -> None:
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from kvserve.service.epp.server import serve

    loop_runner(ns.loop)(serve(config_from_args(ns)))


def loop_runner(loop: str) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """asyncio.run, or uvloop's (`--loop`): grpc.aio runs on either; uvloop took less of the
    EPP's CPU per request in bench/epp.py's runs."""
    if loop == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise SystemExit("kvserve epp: --loop uvloop, but uvloop is not installed") from None
        return asyncio.run
    return uvloop.run


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `kvserve epp` to the CLI's subparsers; the handler is `args.func(args)`."""
    p = subparsers.add_parser(
        "epp", help="Endpoint Picker for a Gateway API Inference Extension gateway",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Envoy ext_proc service (the GIE endpoint-picker protocol): picks the "
                    "replica for each request with the router's prefix-aware scoring and sets "
                    "x-gateway-destination-endpoint.")
    add_arguments(p)
    p.set_defaults(func=run_from_args)
    return p


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvserve.service.epp",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))
