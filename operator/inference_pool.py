"""spec.routing.mode inferencePool: the Gateway API Inference Extension objects of a service (an
InferencePool of the replicas, the `kvserve epp` endpoint picker with its RBAC, an HTTPRoute)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.operator import monitoring, weights
from kvserve.operator.spec import ServiceSpec

Obj = dict[str, Any]
POOL_GROUP = "inference.networking.k8s.io"
POOL_API_VERSION = f"{POOL_GROUP}/v1"
POOL_KIND = "InferencePool"
GRPC_PORT = 9002  # ext_proc: the port GIE's gateways default to for an EPP Service
HEALTH_PORT = 9003  # gRPC health: services "liveness" and "readiness"
METRICS_PORT = 9090
METRICS_CONTAINER_PORT, METRICS_SERVICE_PORT = "metrics", "http-metrics"  # the port's names
DRAIN_SECONDS = 30


@dataclass(frozen=True)
class Kit:
    """What resources.py lends (this module does not import it): metadata(name, component),
    labels and selector of a component, the replicas' port, Redis, env, security contexts."""

    metadata: Callable[[str, str], Obj]
    labels: Callable[[str], dict[str, str]]
    selector: Callable[[str], dict[str, str]]
    engine_port: int
    redis_url: str | None
    env: list[Obj]
    pod_security: Obj
    container_security: Obj


def pool_name(spec: ServiceSpec) -> str:
    """The service's own name: the EPP's Redis key space (kvserve:<service>:...) is the same."""
    return spec.name


def epp_name(spec: ServiceSpec) -> str:
    return f"{spec.name}-epp"


def tokenizer(spec: ServiceSpec) -> str:
    """The router's --tokenizer (resources.router_tokenizer, tested equal): a pvc:// model's
    folder on its claim (mounted by the EPP too), else the hub id the EPP fetches itself.
    Without it the EPP would load the model the replicas announce, a path it does not mount."""
    return weights.model_path(spec) if _on_claim(spec) else spec.model.source


def _on_claim(spec: ServiceSpec) -> bool:
    return spec.model.location.scheme == "pvc"


def epp_args(spec: ServiceSpec, redis_url: str | None) -> list[str]:
    args = ["epp", "--grpc-port", str(GRPC_PORT), "--grpc-health-port", str(HEALTH_PORT),
            "--metrics-port", str(METRICS_PORT), "--pool-name", pool_name(spec),
            "--pool-namespace", spec.namespace]
    args += ["--tokenizer", tokenizer(spec)]
    args += ["--secure-serving"] if spec.routing.secure_serving else []
    if not redis_url:
        return args
    # As the router: the password stays in the env (KVSERVE_REDIS_PASSWORD from the Secret), and
    # the index's key space is the service's name, which the replicas publish under.
    return args + ["--redis-url", redis_url, "--service-name", spec.name]


def grpc_probe(service: str, period: int, failures: int) -> Obj:
    return {"grpc": {"port": HEALTH_PORT, "service": service}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def epp_container(spec: ServiceSpec, kit: Kit) -> Obj:
    return {
        "name": "epp", "image": spec.image, "command": ["kvserve"],
        "args": epp_args(spec, kit.redis_url), "env": kit.env,
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
                  {"name": METRICS_CONTAINER_PORT, "containerPort": METRICS_PORT,
                   "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "readinessProbe": grpc_probe("readiness", 5, 3),
        "livenessProbe": grpc_probe("liveness", 15, 4),
        "securityContext": kit.container_security,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": "/var/cache/kvserve"},
                         *([weights.engine_mount()] if _on_claim(spec) else [])],
    }


def epp_deployment(spec: ServiceSpec, kit: Kit) -> Obj:
    # The EPP watches its pool and the pool's pods: it needs its service account's token.
    pod = {"serviceAccountName": epp_name(spec), "automountServiceAccountToken": True,
           "securityContext": kit.pod_security, "terminationGracePeriodSeconds": DRAIN_SECONDS,
           "containers": [epp_container(spec, kit)],
           "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
                       *([weights.volume(spec)] if _on_claim(spec) else [])]}
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT),
              "prometheus.io/path": "/metrics"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": kit.metadata(epp_name(spec), "epp"),
            "spec": {"replicas": spec.routing.epp_replicas,
                     "selector": {"matchLabels": kit.selector("epp")},
                     "template": {"metadata": {"labels": kit.labels("epp"),
                                               "annotations": scrape}, "spec": pod}}}


def epp_service(spec: ServiceSpec, kit: Kit) -> Obj:
    ports = [{"name": "grpc-ext-proc", "port": GRPC_PORT, "targetPort": GRPC_PORT,
              "protocol": "TCP", "appProtocol": "http2"},  # gateways speak gRPC (HTTP/2) to it
             {"name": "grpc-health", "port": HEALTH_PORT, "targetPort": HEALTH_PORT,
              "protocol": "TCP"},
             {"name": METRICS_SERVICE_PORT, "port": METRICS_PORT, "targetPort": METRICS_PORT,
              "protocol": "TCP"}]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": kit.metadata(epp_name(spec), "epp"),
            "spec": {"type": "ClusterIP", "selector": kit.selector("epp"), "ports": ports}}


def epp_rbac(spec: ServiceSpec, kit: Kit) -> list[Obj]:
    """ServiceAccount, Role (read pods and inferencepools of the namespace) and RoleBinding."""
    name, meta = epp_name(spec), kit.metadata(epp_name(spec), "epp")
    watch = ["get", "list", "watch"]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": watch},
                      {"apiGroups": [POOL_GROUP], "resources": ["inferencepools"],
                       "verbs": watch}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": meta,
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                           "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name,
                             "namespace": spec.namespace}]}
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta,
               "automountServiceAccountToken": False}  # only the EPP pod mounts it
    return [account, role, binding]


def inference_pool(spec: ServiceSpec, kit: Kit) -> Obj:
    """The replicas (the engine Deployment's selector) on their port, picked by the EPP."""
    ref = {"group": "", "kind": "Service", "name": epp_name(spec),
           "port": {"number": GRPC_PORT}, "failureMode": spec.routing.failure_mode}
    return {"apiVersion": POOL_API_VERSION, "kind": POOL_KIND,
            "metadata": kit.metadata(pool_name(spec), "engine"),
            "spec": {"selector": {"matchLabels": kit.selector("engine")},
                     "targetPorts": [{"number": kit.engine_port}], "endpointPickerRef": ref}}


def http_route(spec: ServiceSpec, kit: Kit) -> Obj | None:
    """spec.gateway.parentRefs -> an HTTPRoute whose backend is the pool, not a Service."""
    g = spec.gateway
    if g is None:
        return None
    backend = {"group": POOL_GROUP, "kind": POOL_KIND, "name": pool_name(spec)}
    body: Obj = {"parentRefs": [dict(ref) for ref in g.parent_refs],
                 "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                            "backendRefs": [backend]}]}
    if g.hostnames:
        body["hostnames"] = list(g.hostnames)
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": kit.metadata(spec.name, "entry"), "spec": body}


def objects(spec: ServiceSpec, kit: Kit) -> list[Obj]:
    """Every GIE object of the service in apply order ([] in router mode). The HTTPRoute is
    here, not traffic.http_route's Service-backed one."""
    if not spec.routing.inference_pool:
        return []
    route = http_route(spec, kit)
    monitors = monitoring.epp_monitors(spec, kit.metadata(epp_name(spec), "monitoring"),
                                       METRICS_SERVICE_PORT, METRICS_CONTAINER_PORT)
    return [*epp_rbac(spec, kit), epp_deployment(spec, kit), epp_service(spec, kit),
            inference_pool(spec, kit), *([route] if route else []), *monitors]


def share_pool_ownership(objs: list[Obj]) -> None:
    """After kopf.adopt: the pool keeps one owner reference (the KVInferenceService, so it goes
    with the service) but not as its controller. GIE shares an InferencePool between
    controllers (each gateway writes its own status.parents entry), so none of them may claim
    it as the one controller, and nothing blocks its deletion."""
    for obj in objs:
        refs = obj["metadata"].get("ownerReferences")
        if obj["kind"] == POOL_KIND and obj["apiVersion"] == POOL_API_VERSION and refs:
            obj["metadata"]["ownerReferences"] = [
                {**refs[0], "controller": False, "blockOwnerDeletion": False}]
