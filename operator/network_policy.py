"""NetworkPolicies of a service (ingress only): clients -> router -> replicas, only they reach its
Redis, and Prometheus scrapes /metrics on the same port as the API.

Egress stays open: replicas fetch weights from the hub and reach a Redis anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.operator.inference_pool import GRPC_PORT, METRICS_PORT
from kvserve.operator.spec import ServiceSpec

Obj = dict[str, Any]


def _rule(port: int, peers: list[Obj]) -> Obj:
    """An ingress rule on one TCP port; no peers: from anywhere."""
    rule: Obj = {"ports": [{"protocol": "TCP", "port": port}]}
    if peers:
        rule["from"] = peers
    return rule


def _policy(meta: Obj, pods: dict[str, str], rules: list[Obj]) -> Obj:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": meta,
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"],
                     "ingress": rules}}


def _entry_rules(spec: ServiceSpec, port: int) -> list[Obj]:
    """The entry pods answer clients (all of them unless `clients` narrows it) and Prometheus."""
    clients = list(spec.network_policy.clients)
    if not clients:
        return [_rule(port, [])]
    return [_rule(port, clients + list(spec.network_policy.prometheus))]


def policies(spec: ServiceSpec, metadata: Callable[[str, str], Obj],
             selector: Callable[[str], dict[str, str]], names: dict[str, str], port: int,
             redis_port: int) -> list[Obj]:
    """metadata(name, component) and selector(component) come from resources.py."""
    if not spec.network_policy.enabled:
        return []
    prometheus = list(spec.network_policy.prometheus)
    out = []
    if spec.router_enabled:
        out.append(_policy(metadata(names["router"], "router"), selector("router"),
                           _entry_rules(spec, port)))
        engine_rules = [_rule(port, [{"podSelector": {"matchLabels": selector("router")}},
                                     *prometheus])]
    else:
        engine_rules = _entry_rules(spec, port)
        if spec.routing.inference_pool and "from" in engine_rules[0]:  # the EPP reads replicas
            engine_rules[0]["from"].append({"podSelector": {"matchLabels": selector("epp")}})
    out.append(_policy(metadata(names["engine"], "engine"), selector("engine"), engine_rules))
    if spec.routing.inference_pool:  # the gateway asks the endpoint picker, Prometheus scrapes it
        out.append(_policy(metadata(names["epp"], "epp"), selector("epp"),
                           [*_entry_rules(spec, GRPC_PORT),
                            *([_rule(METRICS_PORT, prometheus)] if prometheus else [])]))
    if spec.redis_deploy:
        reach = ("engine", *(["router"] if spec.router_enabled else []),
                 *(["epp"] if spec.routing.inference_pool else []))
        peers = [{"podSelector": {"matchLabels": selector(c)}} for c in reach]
        out.append(_policy(metadata(names["redis"], "redis"), selector("redis"),
                           [_rule(redis_port, peers)]))
    return out
