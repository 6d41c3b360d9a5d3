"""The objects a KVInferenceService becomes: pure functions of its spec and sizing."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from kvserve.operator import (adapters, co_location, inference_pool, leader_worker_set,
                              monitoring, network_policy, offload, traffic, trust, weights)
from kvserve.operator.crd import API_VERSION, KIND
from kvserve.operator.sizing import Sizing
from kvserve.operator.spec import ServiceSpec

PORT = 8000
REDIS_PORT = 6379
REDIS_IMAGE = "redis:7.4-alpine"
CACHE_USAGE_METRIC = "vllm_kv_cache_usage_perc"  # vllm:kv_cache_usage_perc via prometheus-adapter
WAITING_METRIC = "vllm_num_requests_waiting"  # vllm:num_requests_waiting via prometheus-adapter
# A pod's stop, in order (a rolling update loses no stream): the preStop sleep lets the
# endpoint leave the Service while the pod still serves; then SIGTERM: /health (the readiness
# probe) answers 503, running requests get the drain timeout to finish, and those still running
# are handed back to the router to migrate (issue 41); the margin covers that hand-back and the
# engine's stop. terminationGracePeriodSeconds counts from the preStop hook, so it is the sum.
PRESTOP_SLEEP_SECONDS = 5
DRAIN_TIMEOUT_SECONDS = 100  # the replica's --drain-timeout (alias --shutdown-grace-period)
HANDBACK_MARGIN_SECONDS = 15
DRAIN_SECONDS = PRESTOP_SLEEP_SECONDS + DRAIN_TIMEOUT_SECONDS + HANDBACK_MARGIN_SECONDS  # 120
Obj = dict[str, Any]


def labels(spec: ServiceSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvserve", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "kvserve-operator"}


def selector(spec: ServiceSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": spec.name, "app.kubernetes.io/component": component}


def selector_string(spec: ServiceSpec, component: str = "engine") -> str:
    """status.selector, which the HPA reads through the scale subresource."""
    return ",".join(f"{k}={v}" for k, v in selector(spec, component).items())


def metadata(spec: ServiceSpec, name: str, component: str) -> Obj:
    """Name, namespace, labels; owner references are added by kopf.adopt (children.py)."""
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component)}


def names(spec: ServiceSpec) -> dict[str, str]:
    n = spec.name
    return {"engine": f"{n}-engine", "router": f"{n}-router", "redis": f"{n}-redis",
            "config": f"{n}-config", "entry": n, "epp": f"{n}-epp"}


def redis_url(spec: ServiceSpec) -> str | None:
    if spec.redis_url:
        return spec.redis_url
    return f"redis://{names(spec)['redis']}:{REDIS_PORT}/0" if spec.redis_deploy else None


def milli(value: float) -> str:
    """A Kubernetes quantity for a fraction: 0.8 -> "800m"."""
    return f"{round(value * 1000)}m"


def engine_replicas(spec: ServiceSpec, sizing: Sizing | None = None) -> int:
    """spec.replicas (what `kubectl scale` and the HPA set), kept within autoscaling bounds;
    with spec.sizing.targetConcurrency, at least the replicas that hold the target."""
    a, wanted = spec.autoscaling, spec.replicas
    if sizing is not None and spec.target_concurrency is not None:
        wanted = max(wanted, sizing.replicas_for_target)
    return wanted if a is None else min(max(wanted, a.min_replicas), a.max_replicas)


def engine_args(spec: ServiceSpec, sizing: Sizing) -> list[str]:
    """`kvserve serve` flags from the spec (vLLM's spellings)."""
    e = spec.engine
    args = ["serve", weights.model_path(spec), "--host", "0.0.0.0", "--port", str(PORT),
            "--block-size", str(e.block_size), "--max-model-len", str(e.max_model_len),
            "--max-num-seqs", str(sizing.max_num_seqs),
            "--gpu-memory-utilization", f"{_utilisation(spec, sizing):g}",
            "--kv-cache-dtype", e.kv_cache_dtype, "--swap-space", f"{e.swap_space_gib:g}",
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
            "--dtype", sizing.weight_dtype,
            "--tensor-parallel-size", str(max(sizing.tensor_parallel_size, 1)),
            *(["--pipeline-parallel-size", str(sizing.pipeline_parallel_size)]
              if sizing.pipeline_parallel_size > 1 else []),
            "--served-model-name", spec.model.served_name, *offload.engine_args(e.kv_offloading),
            *adapters.engine_args(spec)]
    # Only a pinned revision: "main" is the engine's default, and an unchanged pod template
    # across operator versions is what keeps an operator upgrade from restarting engines.
    if weights.serves_hub_revision(spec) and spec.model.location.revision != "main":
        args += ["--revision", spec.model.location.revision]
    if spec.device == "cpu":  # the KV budget the operator planned within the pod's memory limit
        co = sizing.co_location
        kv = sizing.kv_bytes if co is None else co.kv_bytes  # type: ignore[attr-defined]
        args += ["--kv-cache-memory", str(max(kv, 0))]
    args += co_location.engine_args(sizing.co_location)  # type: ignore[arg-type]
    url = redis_url(spec)
    if url:
        args += ["--redis-url", url]
    # Drain inside the pod's termination grace period, after the preStop sleep.
    return args + ["--service-name", spec.name, "--advertise-url", f"http://$(POD_IP):{PORT}",
                   "--shutdown-grace-period", str(DRAIN_TIMEOUT_SECONDS)]


def _utilisation(spec: ServiceSpec, sizing: Sizing) -> float:
    """--gpu-memory-utilization: the spec's, less the additional models' weights (spec.models:
    the engine's profiled KV budget must leave them room)."""
    co = sizing.co_location
    return spec.engine.gpu_memory_utilization if co is None else \
        co.gpu_memory_utilization  # type: ignore[attr-defined]


def pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def prestop_sleep() -> Obj:
    """Endpoints update before SIGTERM: the pod leaves the Service while it still serves."""
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}


def http_probe(period: int, failures: int) -> Obj:
    return {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def scrape_annotations() -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
            "prometheus.io/path": "/metrics"}


def engine_resources(spec: ServiceSpec, sizing: Sizing) -> Obj:
    res = json.loads(json.dumps(spec.resources))  # a deep copy that drops nothing
    if sizing.gpus_per_pod:  # a multi-node replica's pods each hold their stages' GPUs
        res.setdefault("limits", {})["nvidia.com/gpu"] = str(sizing.gpus_per_pod)
    return offload.add_resources(spec.engine.kv_offloading, res)


def engine_env(spec: ServiceSpec) -> list[Obj]:
    return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "HF_HOME", "value": "/var/cache/kvserve/hf"},
            {"name": "KVSERVE_CACHE", "value": "/var/cache/kvserve"},
            # Writable places for caches, as the root file system is read-only.
            {"name": "TRITON_CACHE_DIR", "value": "/tmp/triton"},
            {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
            {"name": "KVSERVE_SIZING_FILE", "value": "/etc/kvserve/sizing.json"},
            *adapters.engine_env(spec), *secret_env(spec), *spec.env]


def secret_env(spec: ServiceSpec) -> list[Obj]:
    """The shared registration token, the Redis password and the hub token, from Secrets
    (never as flags)."""
    env = [trust.secret_env(trust.REGISTRATION_TOKEN_ENV, trust.registration_ref(spec.name))]
    if spec.redis_password is not None:
        env.append(trust.secret_env(trust.REDIS_PASSWORD_ENV, spec.redis_password))
    return env + hub_token_env(spec)


def hub_token_env(spec: ServiceSpec) -> list[Obj]:
    """HF_TOKEN from spec.model.tokenSecretRef: gated models download (and tokenize) with it."""
    ref = spec.model.token_secret
    return [] if ref is None else [trust.secret_env("HF_TOKEN", ref)]


def engine_volumes(spec: ServiceSpec, sizing: Sizing) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts): writable scratch for a read-only root FS, the ConfigMap, /dev/shm."""
    vols = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}},
            {"name": "config", "configMap": {"name": names(spec)["config"]}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"},
              {"name": "cache", "mountPath": "/var/cache/kvserve"},
              {"name": "config", "mountPath": "/etc/kvserve", "readOnly": True}]
    if weights.volume(spec) is not None:
        vols.append(weights.volume(spec))
        mounts.append(weights.engine_mount())
    disk = offload.volume(spec.engine.kv_offloading)
    if disk is not None:
        vols.append(disk[0])
        mounts.append(disk[1])
    if sizing.gpus_per_pod > 1:  # NCCL needs a large /dev/shm between a pod's ranks
        vols.append({"name": "shm", "emptyDir": {"medium": "Memory",
                                                 "sizeLimit": shm_size(sizing.gpus_per_pod)}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    return vols, mounts


def shm_size(gpus: int) -> str:
    """/dev/shm for N tensor-parallel ranks: NCCL's shared-memory transport and proxy buffers
    (container runtimes default to 64 MiB, far too little), 1 GiB per rank, at least 2 GiB.
    Memory-backed, so it counts against the pod's memory limit."""
    return f"{max(2, gpus)}Gi"


def engine_container(spec: ServiceSpec, sizing: Sizing, mounts: list[Obj]) -> Obj:
    return {
        "name": "engine", "image": spec.image, "command": ["kvserve"],
        "args": engine_args(spec, sizing), "env": engine_env(spec),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "resources": engine_resources(spec, sizing),
        "startupProbe": http_probe(10, 180),  # model download + load: up to 30 minutes
        "readinessProbe": http_probe(5, 3), "livenessProbe": http_probe(15, 4),
        "lifecycle": prestop_sleep(),
        "securityContext": container_security(), "volumeMounts": mounts,
    }


def config_hash(spec: ServiceSpec, sizing: Sizing) -> str:
    return hashlib.sha256(json.dumps(config_data(spec, sizing), sort_keys=True).encode()
                          ).hexdigest()[:16]


def engine_pod_spec(spec: ServiceSpec, sizing: Sizing, role: str = "") -> Obj:
    """role "leader"/"worker": a pod of a multi-node group (leader_worker_set.py)."""
    vols, mounts = engine_volumes(spec, sizing)
    container = engine_container(spec, sizing, mounts)
    key = trust.secret_env(leader_worker_set.GROUP_KEY_ENV, trust.registration_ref(spec.name))
    if role == "leader":
        container = leader_worker_set.leader_container(container, sizing.nodes_per_replica, key)
    elif role == "worker":
        container = leader_worker_set.worker_container(container, sizing.nodes_per_replica, key)
    tolerations = list(spec.tolerations)
    if sizing.gpus_per_pod:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    pod: Obj = {"securityContext": pod_security(), "automountServiceAccountToken": False,
                "terminationGracePeriodSeconds": DRAIN_SECONDS,
                "containers": [container], "volumes": vols}
    init = weights.init_container(spec, container_security(), mounts[:1])
    if init is not None:
        pod["initContainers"] = [init]
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if tolerations:
        pod["tolerations"] = tolerations
    return pod


def rolling_update() -> Obj:
    """A new pod must be ready before an old one goes: no capacity dip on updates."""
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def engine_deployment(spec: ServiceSpec, sizing: Sizing) -> Obj:
    annotations = {**scrape_annotations(), "kvserve.io/config-hash": config_hash(spec, sizing)}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(spec, names(spec)["engine"], "engine"),
        "spec": {
            "replicas": engine_replicas(spec, sizing),
            "selector": {"matchLabels": selector(spec, "engine")},
            "strategy": offload.strategy(spec.engine.kv_offloading) or rolling_update(),
            "template": {"metadata": {"labels": labels(spec, "engine"),
                                      "annotations": annotations},
                         "spec": engine_pod_spec(spec, sizing)},
        },
    }


def engine_group(spec: ServiceSpec, sizing: Sizing) -> Obj:
    """A multi-node replica's LeaderWorkerSet: leaders labelled `engine` (the Service, router,
    HPA and PDB select them), workers `engine-worker`."""
    annotations = {**scrape_annotations(), "kvserve.io/config-hash": config_hash(spec, sizing)}
    leader = {"metadata": {"labels": labels(spec, "engine"), "annotations": annotations},
              "spec": engine_pod_spec(spec, sizing, "leader")}
    worker = {"metadata": {"labels": labels(spec, leader_worker_set.WORKER_COMPONENT),
                           "annotations": {"kvserve.io/config-hash": annotations[
                               "kvserve.io/config-hash"]}},
              "spec": engine_pod_spec(spec, sizing, "worker")}
    return leader_worker_set.leader_worker_set(
        metadata(spec, names(spec)["engine"], "engine"), engine_replicas(spec, sizing),
        sizing.nodes_per_replica, leader, worker)


def engine_live(spec: ServiceSpec, live: dict[str, Obj]) -> Obj | None:
    """The server's engine workload (a Deployment or a LeaderWorkerSet: both report replicas,
    readyReplicas and updatedReplicas, counting whole groups) among the applied objects."""
    name = names(spec)["engine"]
    return live.get(f"Deployment/{name}") or live.get(f"{leader_worker_set.KIND}/{name}")


def engine_workload(spec: ServiceSpec, sizing: Sizing) -> list[Obj]:
    """A Deployment of single-node replicas, or a LeaderWorkerSet of multi-node ones (and the
    NetworkPolicy that lets a group's ranks reach each other)."""
    if sizing.nodes_per_replica <= 1:
        return [engine_deployment(spec, sizing)]
    group = engine_group(spec, sizing)
    if not spec.network_policy.enabled:
        return [group]
    name = f"{names(spec)['engine']}-group"
    return [group, leader_worker_set.group_policy(
        metadata(spec, name, "engine"), {"app.kubernetes.io/instance": spec.name},
        names(spec)["engine"])]


def service(spec: ServiceSpec, name: str, component: str, target: str, port: int) -> Obj:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": metadata(spec, name, component),
        "spec": {"type": "ClusterIP", "selector": selector(spec, target),
                 "ports": [{"name": "http" if port == PORT else "redis", "port": port,
                            "targetPort": port, "protocol": "TCP"}]},
    }


def config_data(spec: ServiceSpec, sizing: Sizing) -> dict[str, str]:
    return {"sizing.json": json.dumps(sizing.as_status(), indent=2, sort_keys=True),
            "model": spec.model.source, "served-model-name": spec.model.served_name}


def config_map(spec: ServiceSpec, sizing: Sizing) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(spec, names(spec)["config"], "engine"),
            "data": config_data(spec, sizing)}


def pdb(spec: ServiceSpec) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": metadata(spec, names(spec)["engine"], "engine"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(spec, "engine")}}}


def router_tokenizer(spec: ServiceSpec) -> str:
    """The router tokenizes like the engine; a cache claim fills only after the engine's init
    container ran, so the router fetches the (small) tokenizer itself then."""
    return weights.model_path(spec) if spec.model.location.scheme == "pvc" else spec.model.source


def router_deployment(spec: ServiceSpec) -> Obj:
    args = ["router", "--host", "0.0.0.0", "--port", str(PORT)]
    url = redis_url(spec)
    if url:
        args += ["--redis-url", url]
    # The engine Service is the static fallback: without Redis the router routes by load alone.
    args += ["--service-name", spec.name, "--policy", spec.router_policy,
             "--tokenizer", router_tokenizer(spec),
             "--replicas", f"http://{names(spec)['engine']}:{PORT}", *adapters.router_args(spec),
             # The router drains too: new requests get 503 while in-flight streams finish.
             "--shutdown-grace-period", str(DRAIN_SECONDS - 20)]
    container = {
        "name": "router", "image": spec.image, "command": ["kvserve"], "args": args,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": [{"name": "HF_HOME", "value": "/var/cache/kvserve/hf"}, *secret_env(spec),
                *spec.env],
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "readinessProbe": http_probe(5, 3), "livenessProbe": http_probe(15, 4),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},  # endpoints update first
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": "/var/cache/kvserve"}],
    }
    pod = {"securityContext": pod_security(), "automountServiceAccountToken": False,
           "terminationGracePeriodSeconds": DRAIN_SECONDS, "containers": [container],
           "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]}
    if spec.model.location.scheme == "pvc":  # the tokenizer files live on the claim only
        pod["volumes"].append(weights.volume(spec))
        container["volumeMounts"].append(weights.engine_mount())
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(spec, names(spec)["router"], "router"),
        "spec": {"replicas": spec.router_replicas,
                 "selector": {"matchLabels": selector(spec, "router")},
                 "template": {"metadata": {"labels": labels(spec, "router"),
                                           "annotations": scrape_annotations()},
                              "spec": pod}},
    }


REDIS_ARGS = ["--save", "", "--appendonly", "no", "--maxmemory", "512mb",
              "--maxmemory-policy", "allkeys-lru"]
# requirepass goes through a file on a memory volume, not a flag: flags show in `ps`.
REDIS_AUTH_SCRIPT = ('umask 077; printf \'requirepass "%s"\\n\' "$REDIS_PASSWORD" '
                     '> /run/redis/auth.conf; exec redis-server /run/redis/auth.conf "$@"')


def redis_command(spec: ServiceSpec) -> Obj:
    """The prefix index is a cache rebuilt from heartbeats: no persistence, bounded memory."""
    if spec.redis_password is None:
        return {"args": ["redis-server", *REDIS_ARGS]}
    return {"command": ["sh", "-c", REDIS_AUTH_SCRIPT, "redis-server"], "args": REDIS_ARGS,
            "env": [trust.secret_env("REDIS_PASSWORD", spec.redis_password)]}


def redis_deployment(spec: ServiceSpec) -> Obj:
    container = {
        "name": "redis", "image": REDIS_IMAGE, **redis_command(spec),
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"memory": "768Mi"}},
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 15},
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    security = {**pod_security(), "runAsUser": 999, "runAsGroup": 999, "fsGroup": 999}
    pod = {"securityContext": security, "automountServiceAccountToken": False,
           "containers": [container], "volumes": [{"name": "data", "emptyDir": {}}]}
    if spec.redis_password is not None:
        pod["volumes"].append({"name": "auth", "emptyDir": {"medium": "Memory",
                                                            "sizeLimit": "1Mi"}})
        container["volumeMounts"].append({"name": "auth", "mountPath": "/run/redis"})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(spec, names(spec)["redis"], "redis"),
        "spec": {"replicas": 1, "selector": {"matchLabels": selector(spec, "redis")},
                 "strategy": {"type": "Recreate"},
                 "template": {"metadata": {"labels": labels(spec, "redis")}, "spec": pod}},
    }


def pods_metric(name: str, average: str) -> Obj:
    return {"type": "Pods", "pods": {"metric": {"name": name},
                                     "target": {"type": "AverageValue", "averageValue": average}}}


def hpa(spec: ServiceSpec) -> Obj:
    """HPA on the KVInferenceService's scale subresource: it sets spec.replicas, we follow."""
    a = spec.autoscaling
    assert a is not None
    metrics = [pods_metric(CACHE_USAGE_METRIC, milli(a.target_cache_usage))]
    if a.target_waiting_requests:
        metrics.append(pods_metric(WAITING_METRIC, str(a.target_waiting_requests)))
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(spec, names(spec)["entry"], "engine"),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": spec.name},
            "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas, "metrics": metrics,
            "behavior": scale_behavior(),
        },
    }


def scale_behavior() -> Obj:
    """GPU replicas take minutes to load: add one at a time, remove slowly (HPA and KEDA)."""
    return {
        "scaleUp": {"stabilizationWindowSeconds": 60,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
        "scaleDown": {"stabilizationWindowSeconds": 600,
                      "policies": [{"type": "Pods", "value": 1, "periodSeconds": 300}]},
    }


def desired_objects(spec: ServiceSpec, sizing: Sizing) -> list[Obj]:
    """Everything the service needs, in the order to apply it."""
    n = names(spec)
    objs = [config_map(spec, sizing)]
    objs += _present(weights.claim(spec, metadata(spec, weights_claim(spec), "engine")))
    if spec.redis_deploy:
        objs += [redis_deployment(spec), service(spec, n["redis"], "redis", "redis", REDIS_PORT)]
    objs += _present(adapter_fetch_job(spec))
    objs += [*engine_workload(spec, sizing),
             service(spec, n["engine"], "engine", "engine", PORT), pdb(spec)]
    entry_target = "router" if spec.router_enabled else "engine"
    if spec.router_enabled:
        objs.append(router_deployment(spec))
    objs.append(service(spec, n["entry"], "entry", entry_target, PORT))
    if spec.autoscaling is not None and spec.autoscaling.engine == "hpa":
        objs.append(hpa(spec))
    entry = metadata(spec, n["entry"], "entry")
    objs += _present(
        monitoring.scaled_object(spec, metadata(spec, n["entry"], "engine"), n["engine"],
                                 scale_behavior(), leaders=sizing.nodes_per_replica > 1),
        traffic.ingress(spec, entry, n["entry"]),
        None if spec.routing.inference_pool else traffic.http_route(spec, entry, n["entry"], PORT),
        monitoring.service_monitor(spec, metadata(spec, n["entry"], "monitoring")),
        monitoring.pod_monitor(spec, metadata(spec, n["entry"], "monitoring")))
    objs += inference_pool.objects(spec, pool_kit(spec))
    objs += network_policy.policies(spec, lambda name, c: metadata(spec, name, c),
                                    lambda c: selector(spec, c), n, PORT, REDIS_PORT)
    return objs


def pool_kit(spec: ServiceSpec) -> inference_pool.Kit:
    """The pieces inference_pool.py builds the endpoint picker from (the router's Redis URL and
    password Secret, hub token, extra env)."""
    env = [{"name": "HF_HOME", "value": "/var/cache/kvserve/hf"}, *hub_token_env(spec),
           *spec.env]
    if spec.redis_password is not None:
        env.insert(1, trust.secret_env(trust.REDIS_PASSWORD_ENV, spec.redis_password))
    return inference_pool.Kit(
        metadata=lambda name, c: metadata(spec, name, c), labels=lambda c: labels(spec, c),
        selector=lambda c: selector(spec, c), engine_port=PORT, redis_url=redis_url(spec),
        env=env, pod_security=pod_security(), container_security=container_security())


def adapter_fetch_job(spec: ServiceSpec) -> Obj | None:
    """The Job that fetches hub adapters into the weights cache (operator/adapters.py)."""
    name = adapters.fetch_job_name(spec)
    if name is None:
        return None
    ref = spec.model.token_secret
    token = [] if ref is None else [trust.secret_env("HF_TOKEN", ref)]
    container = {
        "name": "fetch-adapters", "image": spec.image,
        "command": adapters.fetch_command(spec, weights.WEIGHTS_DIR),
        "env": [{"name": "HF_HOME", "value": "/tmp/hf"}, {"name": "XDG_CACHE_HOME",
                                                          "value": "/tmp"}, *token, *spec.env],
        "securityContext": container_security(),
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"},
                      "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": weights.VOLUME, "mountPath": weights.WEIGHTS_DIR}]}
    pod = {"securityContext": pod_security(), "automountServiceAccountToken": False,
           "restartPolicy": "OnFailure", "containers": [container],
           "volumes": [{"name": "tmp", "emptyDir": {}}, weights.volume(spec)]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata(spec, name, "fetch"),
            "spec": {"backoffLimit": 6, "template": {
                "metadata": {"labels": labels(spec, "fetch")}, "spec": pod}}}


def registration_secret(spec: ServiceSpec, token: str) -> Obj:
    """Created once, never applied again (reconcile.create_once): see trust.py."""
    return trust.registration_secret(
        metadata(spec, trust.registration_secret_name(spec.name), "registration"), token)


def _present(*objs: Obj | None) -> list[Obj]:
    return [o for o in objs if o is not None]


def weights_claim(spec: ServiceSpec) -> str:
    return spec.model.cache.claim_name if spec.model.cache else ""
