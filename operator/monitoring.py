"""Scrape objects for prometheus-operator (ServiceMonitor, PodMonitor) and the KEDA ScaledObject
that scales on the same series; both copy the pods' instance and component labels onto them."""

from __future__ import annotations

from typing import Any

from kvserve.operator.crd import API_VERSION, KIND
from kvserve.operator.spec import ServiceSpec

Obj = dict[str, Any]
TARGET_LABELS = ["app.kubernetes.io/instance", "app.kubernetes.io/component"]
CACHE_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"


def _selector(spec: ServiceSpec, components: list[str]) -> Obj:
    return {"matchLabels": {"app.kubernetes.io/instance": spec.name,
                            "app.kubernetes.io/managed-by": "kvserve-operator"},
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                                  "values": components}]}


def _meta(spec: ServiceSpec, meta: Obj) -> Obj:
    extra = spec.monitoring.labels
    return {**meta, "labels": {**extra, **meta["labels"]}} if extra else meta


def service_monitor(spec: ServiceSpec, meta: Obj) -> Obj | None:
    """The engine Service, and the entry Service when it fronts router pods (not twice the
    engine pods when the router is off)."""
    if not spec.monitoring.service_monitor:
        return None
    components = ["engine", "entry"] if spec.router_enabled else ["engine"]
    endpoint = {"port": "http", "path": "/metrics", "interval": spec.monitoring.interval}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": _meta(spec, meta),
            "spec": {"selector": _selector(spec, components), "endpoints": [endpoint],
                     "podTargetLabels": TARGET_LABELS}}


def pod_monitor(spec: ServiceSpec, meta: Obj) -> Obj | None:
    if not spec.monitoring.pod_monitor:
        return None
    components = ["engine", "router"] if spec.router_enabled else ["engine"]
    endpoint = {"port": "http", "path": "/metrics", "interval": spec.monitoring.interval}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
            "metadata": _meta(spec, meta),
            "spec": {"selector": _selector(spec, components), "podMetricsEndpoints": [endpoint],
                     "podTargetLabels": TARGET_LABELS}}


def epp_monitors(spec: ServiceSpec, meta: Obj, service_port: str, pod_port: str) -> list[Obj]:
    """spec.routing.mode inferencePool: the endpoint picker's /metrics, on a port of its own (so
    monitors of their own: every port a monitor names is one each object it selects has)."""
    out = []
    if spec.monitoring.service_monitor:
        endpoint = {"port": service_port, "path": "/metrics", "interval": spec.monitoring.interval}
        out.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                    "metadata": _meta(spec, meta),
                    "spec": {"selector": _selector(spec, ["epp"]), "endpoints": [endpoint],
                             "podTargetLabels": TARGET_LABELS}})
    if spec.monitoring.pod_monitor:
        endpoint = {"port": pod_port, "path": "/metrics", "interval": spec.monitoring.interval}
        out.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                    "metadata": _meta(spec, meta),
                    "spec": {"selector": _selector(spec, ["epp"]),
                             "podMetricsEndpoints": [endpoint], "podTargetLabels": TARGET_LABELS}})
    return out


def engine_series(spec: ServiceSpec, metric: str, engine_deployment: str,
                  leaders: bool = False) -> str:
    """A selector of one service's engine pods: Deployment pods are <deployment>-<rs>-<id>;
    a LeaderWorkerSet's leaders <name>-<group> (its workers, <name>-<group>-<i>, serve no
    metrics)."""
    pods = f"{engine_deployment}-[0-9]+" if leaders else \
        f"{engine_deployment}-[a-z0-9]+-[a-z0-9]+"
    return f'{metric}{{namespace="{spec.namespace}",pod=~"{pods}"}}'


def _trigger(spec: ServiceSpec, query: str, threshold: str) -> Obj:
    # AverageValue: KEDA's HPA divides the sum by the replica count, as our HPA's pod metrics do.
    return {"type": "prometheus", "metricType": "AverageValue",
            "metadata": {"serverAddress": spec.autoscaling.prometheus_address, "query": query,
                         "threshold": threshold}}


def scaled_object(spec: ServiceSpec, meta: Obj, engine_deployment: str,
                  behavior: Obj, leaders: bool = False) -> Obj | None:
    """KEDA instead of the HPA: it scales the KVInferenceService's scale subresource, like it."""
    a = spec.autoscaling
    if a is None or a.engine != "keda":
        return None
    def series(metric: str) -> str:
        return engine_series(spec, metric, engine_deployment, leaders)

    triggers = [_trigger(spec, f"sum({series(CACHE_USAGE)})", f"{a.target_cache_usage:g}")]
    if a.target_waiting_requests:
        triggers.append(_trigger(spec, f"sum({series(WAITING)})", str(a.target_waiting_requests)))
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND,
                                        "name": spec.name},
                     "minReplicaCount": a.min_replicas, "maxReplicaCount": a.max_replicas,
                     "pollingInterval": 15, "cooldownPeriod": 300,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": behavior}},
                     "triggers": triggers}}
