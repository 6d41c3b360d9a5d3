"""A KVInferenceService's spec, defaulted and checked against the CRD schema, as dataclasses."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.engine.defaults import GPUS_PER_NODE
from kvserve.operator.catalog import GPUS, MODELS, ModelArch, lookup_model
from kvserve.operator import disaggregation as pd
from kvserve.operator.crd import DEFAULT_IMAGE, MAX_GPUS_PER_REPLICA, spec_schema
from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.model_uri import ModelURI, parse_model_uri
from kvserve.operator.offload import KVOffloading
from kvserve.operator.offload import parse as parse_offloading
from kvserve.operator.quantity import GiB, parse_quantity
from kvserve.operator.trust import SecretRef, password_in_url
from kvserve.service.prefix_index.redis_client import parse_redis_url

if TYPE_CHECKING:
    from kvserve.operator.model_files import ModelReader

WEIGHTS_DIR = "/var/lib/kvserve/weights"  # where engine pods mount the weights cache (weights.py)
# Where `kvserve.operator.fetch --adapter` puts a hub adapter inside the weights cache.
ADAPTERS_DIR = "adapters"
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def apply_defaults(schema: dict, value: Any) -> Any:
    """A copy of value with the schema's defaults filled in, as the API server does."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [apply_defaults(schema["items"], item) for item in value]
    return value


def _type_ok(kind: str | None, value: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return kind is None or isinstance(value, _TYPES[kind])


def _scalar_errors(schema: dict, value: Any, path: str) -> list[str]:
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        errors.append(f"{path}: {value} is below the minimum {schema['minimum']}")
    if "maximum" in schema and isinstance(value, (int, float)) and value > schema["maximum"]:
        errors.append(f"{path}: {value} is above the maximum {schema['maximum']}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        errors.append(f"{path}: must not be empty")
    if isinstance(value, str) and "pattern" in schema and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']}")
    return errors


def schema_errors(schema: dict, value: Any, path: str = "spec") -> list[str]:
    """Messages for every place value breaks the schema's type/enum/range/required rules."""
    if not _type_ok(schema.get("type"), value):
        return [f"{path}: expected {schema['type']}, got {type(value).__name__}"]
    errors = _scalar_errors(schema, value, path)
    if isinstance(value, dict):
        errors += [f"{path}.{key}: required" for key in schema.get("required", [])
                   if key not in value]
        props = schema.get("properties", {})
        for key, sub in value.items():
            if key in props:
                errors += schema_errors(props[key], sub, f"{path}.{key}")
            elif props and not schema.get("x-kubernetes-preserve-unknown-fields"):
                errors.append(f"{path}.{key}: unknown field")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(schema["items"], item, f"{path}[{i}]")
    return errors


@dataclass(frozen=True)
class CacheSpec:
    """A weights cache claim: an existing one (create False) or one the operator owns."""

    claim_name: str
    create: bool
    size: str = "100Gi"
    access_mode: str = "ReadWriteMany"
    storage_class: str | None = None


@dataclass(frozen=True)
class ModelRef:
    key: str  # catalog key or the user's name
    source: str  # what `kvserve serve` loads when no cache or claim is mounted
    served_name: str
    arch: ModelArch
    location: ModelURI = field(default_factory=lambda: ModelURI("name", ""))
    cache: CacheSpec | None = None
    token_secret: SecretRef | None = None  # the hub token (gated models): sizing and pods


@dataclass(frozen=True)
class LoraSpec:
    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    uri: str  # as written in the spec (status echoes it)
    location: ModelURI
    path: str  # what a replica loads: POST /v1/load_lora_adapter {"lora_path": path}

    @property
    def fetched(self) -> bool:
        """A hub adapter: the fetch Job copies it into the weights cache first."""
        return self.location.scheme == "hf"


def parse_adapters(raw: list[dict], model: ModelRef, weights_dir: str) -> tuple[AdapterSpec, ...]:
    """spec.adapters as AdapterSpecs; InvalidSpecError names the adapter and what to change."""
    seen: set[str] = set()
    out = []
    for i, item in enumerate(raw):
        name, uri = item["name"], item["uri"]
        where = f"spec.adapters[{i}] ({name})"
        if name in seen:
            raise InvalidSpecError(f"{where}: the name is used twice", reason="InvalidAdapter")
        if name == model.served_name:
            raise InvalidSpecError(f"{where}: the name is the served model's own name; requests "
                                   "could not tell them apart", reason="InvalidAdapter")
        seen.add(name)
        try:
            location = parse_model_uri(uri)
        except InvalidSpecError as exc:
            raise InvalidSpecError(f"{where}: {exc}", reason="InvalidAdapter") from None
        out.append(AdapterSpec(name, uri, location, _path(where, location, model, weights_dir)))
    return tuple(out)


def _path(where: str, loc: ModelURI, model: ModelRef, weights_dir: str) -> str:
    if loc.scheme == "hf":
        if model.cache is None:
            raise InvalidSpecError(
                f"{where}: a hub adapter is fetched into the weights cache; set "
                "spec.model.cache (or put it on the model's claim: pvc://CLAIM/PATH)",
                reason="InvalidAdapter")
        return f"{weights_dir}/{ADAPTERS_DIR}/{loc.slug}"
    if loc.scheme == "pvc":
        claim = model.location.claim if model.location.scheme == "pvc" else \
            (model.cache.claim_name if model.cache is not None else "")
        if loc.claim != claim:
            raise InvalidSpecError(
                f"{where}: pvc://{loc.claim} is not the claim the engine pods mount "
                f"({claim or 'none'}): a new volume would restart them; copy the adapter to "
                "the model's claim", reason="InvalidAdapter")
        return f"{weights_dir}/{loc.path}".rstrip("/")
    if loc.scheme == "path" and loc.path.startswith("/"):
        return loc.path
    raise InvalidSpecError(f"{where}: write hf://ORG/NAME[:REVISION], pvc://CLAIM/PATH or an "
                           "absolute path inside the image", reason="InvalidAdapter")


@dataclass(frozen=True)
class IngressSpec:
    host: str
    path: str
    class_name: str | None = None
    tls_secret: str | None = None
    annotations: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GatewaySpec:
    parent_refs: list
    hostnames: list = field(default_factory=list)


@dataclass(frozen=True)
class RoutingSpec:
    """spec.routing: the router (default) or an InferencePool with kvserve's endpoint picker."""

    mode: str = "router"  # "router" | "inferencePool"
    failure_mode: str = "FailClose"  # the pool's endpointPickerRef.failureMode
    epp_replicas: int = 1
    secure_serving: bool = False  # the EPP's ext_proc port over TLS (self-signed)

    @property
    def inference_pool(self) -> bool:
        return self.mode == "inferencePool"


@dataclass(frozen=True)
class MonitoringSpec:
    service_monitor: bool = False
    pod_monitor: bool = False
    interval: str = "15s"
    labels: dict = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkPolicySpec:
    enabled: bool = True
    clients: list = field(default_factory=list)  # NetworkPolicyPeers; empty: from anywhere
    prometheus: list = field(default_factory=list)  # NetworkPolicyPeers that scrape /metrics


@dataclass(frozen=True)
class EngineSpec:
    block_size: int
    max_model_len: int
    max_num_seqs: int | None
    gpu_memory_utilization: float
    kv_cache_dtype: str
    enable_prefix_caching: bool
    swap_space_gib: float
    dtype: str
    kv_offloading: KVOffloading | None = None  # the host (and disk) tier; None: off


@dataclass(frozen=True)
class Autoscaling:
    min_replicas: int
    max_replicas: int
    target_cache_usage: float
    target_waiting_requests: int
    engine: str = "hpa"  # "hpa" | "keda"
    prometheus_address: str = ""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    namespace: str
    uid: str
    model: ModelRef
    engine: EngineSpec
    device: str
    gpu_type: str | None
    gpu_memory_bytes: int  # per GPU (cuda) or per pod (cpu)
    max_gpus_per_replica: int
    replicas: int
    autoscaling: Autoscaling | None
    router_enabled: bool
    router_policy: str
    router_replicas: int
    redis_url: str | None
    redis_deploy: bool
    image: str = DEFAULT_IMAGE
    resources: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    tolerations: list = field(default_factory=list)
    env: list = field(default_factory=list)
    ingress: IngressSpec | None = None
    gateway: GatewaySpec | None = None
    monitoring: MonitoringSpec = MonitoringSpec()
    redis_password: SecretRef | None = None
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    adapters: tuple[AdapterSpec, ...] = ()  # spec.adapters (operator/adapters.py)
    lora: LoraSpec = LoraSpec()  # spec.engine.lora
    routing: RoutingSpec = RoutingSpec()  # spec.routing
    disaggregation: pd.Disaggregation | None = None  # spec.disaggregation (pd_roles.py)
    gpus_per_node: int = GPUS_PER_NODE  # spec.gpu.perNode, else the GPU type's node
    target_concurrency: int | None = None  # spec.sizing.targetConcurrency
    memory_bandwidth: float = 0.0  # bytes/s per GPU (catalog), for the latency estimate
    models: tuple[ModelRef, ...] = ()  # spec.models: more models in each replica (co_location.py)


def _arch_from_spec(a: dict, source: str) -> ModelArch:
    heads = a.get("heads", a["kvHeads"])
    hidden = a.get("hiddenSize", heads * a["headDim"])
    return ModelArch(
        layers=a["layers"], heads=heads, kv_heads=a["kvHeads"], head_dim=a["headDim"],
        hidden=hidden, intermediate=a.get("intermediateSize", 4 * hidden),
        vocab=a.get("vocabSize", 32000), parameters=a["parameters"],
        dtype=a.get("dtype", "bfloat16"), max_model_len=a.get("maxModelLen", 4096), source=source,
        origin="spec.model.architecture")


def cache_spec(cache: dict | None, location: ModelURI, cr_name: str) -> CacheSpec | None:
    if cache is None:
        return None
    if ("claimName" in cache) == ("pvc" in cache):
        raise InvalidSpecError("spec.model.cache: set exactly one of claimName and pvc")
    if location.scheme == "path":
        raise InvalidSpecError("spec.model.cache: a local path has nothing to fetch; use "
                               "hf://ORG/NAME, a catalog name, or pvc://CLAIM/PATH")
    if location.scheme == "pvc":
        raise InvalidSpecError("spec.model.cache: a pvc:// uri already names the claim holding "
                               "the weights; drop spec.model.cache")
    if "claimName" in cache:
        return CacheSpec(claim_name=cache["claimName"], create=False)
    pvc = cache["pvc"]
    return CacheSpec(claim_name=f"{cr_name}-weights", create=True, size=pvc["size"],
                     access_mode=pvc["accessMode"], storage_class=pvc.get("storageClassName"))


def _catalog_or_files(model: dict, location: ModelURI | None, reader: ModelReader | None,
                      namespace: str, env: list) -> tuple[str, ModelArch]:
    """The catalog entry of the uri (what is served) or of the name; else, with a reader, the
    model's own files. A uri outside the catalog is never sized by its name's entry: a
    quantised or fine-tuned checkpoint is not the base model."""
    name = model.get("name")
    if location is None and name and reader is not None and lookup_model(name) is None:
        location = parse_model_uri(name, model.get("revision"))  # a hub id given as name
    if location is not None:
        found = lookup_model(location.path)
        if found is None and location.scheme == "pvc" and name:
            found = lookup_model(name)  # weights on a claim: the name says which model
        if found is not None:
            return found
        if reader is not None and location.scheme in ("hf", "path", "pvc"):
            ref = model.get("tokenSecretRef")
            token = SecretRef(ref["name"], ref["key"]) if ref else None
            return name or location.path, reader.arch(location, namespace, token, env)
    found = lookup_model(name) if name else None
    if found is None:
        raise InvalidSpecError(
            f"model {name or model.get('uri')!r} is not in the catalog "
            f"({', '.join(sorted(MODELS))}) and has no files the operator can read: give a hub "
            "id (hf://ORG/NAME) or describe it with spec.model.architecture {layers, kvHeads, "
            "headDim, parameters}", reason="UnknownModel")
    return found


def model_ref(model: dict, cr_name: str, reader: ModelReader | None = None,
              namespace: str = "", env: list | None = None) -> ModelRef:
    """Resolve spec.model against the catalog or the model's own files (with a reader), or read
    its explicit architecture."""
    name, uri = model.get("name"), model.get("uri")
    if not name and not uri:
        raise InvalidSpecError("spec.model needs a name (from the catalog) or a uri")
    location = parse_model_uri(uri or "", model.get("revision")) if uri else None
    if location is not None and location.scheme == "hf":
        uri = location.path  # what the engine and the catalog know: the bare hub id
    if "architecture" in model:
        arch = _arch_from_spec(model["architecture"], uri or name)
        key = name or uri
    else:
        key, arch = _catalog_or_files(model, location, reader, namespace, env or [])
    served = model.get("servedModelName") or name or cr_name
    source = uri or arch.source or key
    if location is None:
        location = parse_model_uri(source, model.get("revision"))
    ref = model.get("tokenSecretRef")
    return ModelRef(key=key, source=source, served_name=served, arch=arch, location=location,
                    cache=cache_spec(model.get("cache"), location, cr_name),
                    token_secret=SecretRef(ref["name"], ref["key"]) if ref else None)


def engine_spec(e: dict, arch: ModelArch, max_replicas: int = 1) -> EngineSpec:
    max_len = e.get("maxModelLen", arch.max_model_len)
    if max_len > arch.max_model_len:
        raise InvalidSpecError(
            f"spec.engine.maxModelLen {max_len} exceeds the model's context length "
            f"{arch.max_model_len}; lower it")
    return EngineSpec(
        block_size=e["blockSize"], max_model_len=max_len, max_num_seqs=e.get("maxNumSeqs"),
        gpu_memory_utilization=float(e["gpuMemoryUtilization"]),
        kv_cache_dtype=e["kvCacheDtype"], enable_prefix_caching=e["enablePrefixCaching"],
        swap_space_gib=float(e["swapSpaceGiB"]), dtype=e["dtype"],
        kv_offloading=parse_offloading(e.get("kvOffloading"), e["enablePrefixCaching"],
                                       max_replicas))


def device_memory(spec: dict) -> tuple[str | None, int]:
    """(gpu type, bytes per GPU) for cuda; (None, pod memory limit) for cpu."""
    gpu = spec["gpu"]
    if spec["device"] == "cpu":
        limit = spec.get("resources", {}).get("limits", {}).get("memory")
        if limit is None:
            raise InvalidSpecError("device cpu is sized by spec.resources.limits.memory; set it "
                                   "(e.g. 4Gi)")
        return None, parse_quantity(limit)
    if "memoryGiB" in gpu:
        return gpu.get("type"), int(float(gpu["memoryGiB"]) * GiB)
    if "type" in gpu:
        return gpu["type"], GPUS[gpu["type"]].memory_bytes
    raise InvalidSpecError(
        f"set spec.gpu.type (one of {', '.join(GPUS)}) or spec.gpu.memoryGiB")


def node_shape(spec: dict, gpu_type: str | None) -> tuple[int, float]:
    """(GPUs per node, memory bandwidth per GPU) from spec.gpu.perNode and the catalog."""
    known = GPUS.get(gpu_type or "")
    per_node = spec["gpu"].get("perNode") or (known.per_node if known else GPUS_PER_NODE)
    return int(per_node), known.memory_bandwidth if known else 0.0


def _autoscaling(spec: dict) -> Autoscaling | None:
    a = spec.get("autoscaling")
    if a is None:
        return None
    if a["minReplicas"] > a["maxReplicas"]:
        raise InvalidSpecError(f"spec.autoscaling.minReplicas {a['minReplicas']} is above "
                               f"maxReplicas {a['maxReplicas']}")
    return Autoscaling(a["minReplicas"], a["maxReplicas"], float(a["targetCacheUsage"]),
                       a["targetWaitingRequests"], a["engine"], a["prometheusAddress"])


def _traffic(spec: dict) -> tuple[IngressSpec | None, GatewaySpec | None, MonitoringSpec]:
    i, g, m = spec.get("ingress"), spec.get("gateway"), spec["monitoring"]
    ingress = None if i is None else IngressSpec(
        host=i["host"], path=i["path"], class_name=i.get("className"),
        tls_secret=i.get("tlsSecretName"), annotations=i.get("annotations", {}))
    gateway = None if g is None else GatewaySpec(g["parentRefs"], g.get("hostnames", []))
    return ingress, gateway, MonitoringSpec(m["serviceMonitor"], m["podMonitor"], m["interval"],
                                            m.get("labels", {}))


def _redis(redis: dict) -> tuple[str | None, bool, SecretRef | None]:
    """(url, deploy, password Secret); a password written into the URL is refused."""
    url = redis.get("url")
    if password_in_url(url):
        raise InvalidSpecError(
            f"spec.redis.url embeds a password ({url}); it must not be in the spec (the CR, the "
            "pod args and logs would show it): create a Secret (kubectl create secret generic "
            "NAME --from-literal=password=...) and set spec.redis.passwordSecretRef "
            "{name: NAME, key: password}", reason="RedisPasswordInSpec")
    if url:
        try:  # the parser every component uses (schemes, hosts, ports, the master set's name)
            parse_redis_url(url, flag="spec.redis.url")
        except ValueError as exc:
            raise InvalidSpecError(str(exc), reason="InvalidRedisURL") from None
    ref = redis.get("passwordSecretRef")
    password = None if ref is None else SecretRef(ref["name"], ref["key"])
    return url, redis["deploy"] and not url, password


def _network_policy(n: dict) -> NetworkPolicySpec:
    return NetworkPolicySpec(n["enabled"], n.get("clients", []), n["prometheus"])


def parse_spec(body: dict, reader: ModelReader | None = None) -> ServiceSpec:
    """Default, check and read a KVInferenceService object; InvalidSpecError says what to fix.
    With a reader, a model outside the catalog is sized from its own files."""
    meta = body.get("metadata", {})
    schema = spec_schema()
    spec = apply_defaults(schema, body.get("spec") or {})
    errors = schema_errors(schema, spec)
    if errors:
        raise InvalidSpecError("; ".join(errors))
    namespace = meta.get("namespace", "default")
    model = model_ref(spec["model"], meta.get("name", ""), reader, namespace,
                      spec.get("env", []))
    gpu_type, memory = device_memory(spec)
    router = spec["router"]
    r = spec["routing"]
    routing = RoutingSpec(r["mode"], r["failureMode"], r["eppReplicas"],
                          r.get("secureServing", False))
    redis_url, redis_deploy, redis_password = _redis(spec["redis"])
    ingress, gateway, monitoring = _traffic(spec)
    autoscaling = _autoscaling(spec)
    adapters = parse_adapters(spec.get("adapters", []), model, WEIGHTS_DIR)
    lora = spec["engine"]["lora"]
    max_replicas = spec["replicas"] if autoscaling is None else autoscaling.max_replicas
    dis = pd.parse(spec.get("disaggregation"))
    if dis is not None:
        pd.check(dis, autoscaling=autoscaling is not None, router_enabled=router["enabled"],
                 inference_pool=routing.inference_pool, adapters=bool(adapters))
    per_node, bandwidth = node_shape(spec, gpu_type)
    return ServiceSpec(
        name=meta.get("name", ""), namespace=meta.get("namespace", "default"),
        uid=meta.get("uid", ""), model=model,
        engine=engine_spec(spec["engine"], model.arch, max_replicas),
        device=spec["device"], gpu_type=gpu_type, gpu_memory_bytes=memory,
        max_gpus_per_replica=spec["gpu"].get("maxPerReplica", MAX_GPUS_PER_REPLICA),
        replicas=spec["replicas"], gpus_per_node=per_node, memory_bandwidth=bandwidth,
        target_concurrency=spec.get("sizing", {}).get("targetConcurrency"),
        # inferencePool mode: the gateway and the endpoint picker route; no router Deployment.
        autoscaling=autoscaling, router_enabled=router["enabled"] and not routing.inference_pool,
        router_policy=router["policy"], router_replicas=router["replicas"],
        redis_url=redis_url, redis_deploy=redis_deploy, redis_password=redis_password,
        network_policy=_network_policy(spec["networkPolicy"]),
        image=spec["image"], resources=spec.get("resources", {}),
        node_selector=spec.get("nodeSelector", {}), tolerations=spec.get("tolerations", []),
        env=spec.get("env", []), ingress=ingress, gateway=gateway, monitoring=monitoring,
        adapters=adapters, lora=LoraSpec(lora["enabled"], lora["maxLoras"],
                                         lora["maxLoraRank"]), routing=routing,
        disaggregation=dis,
        models=tuple(model_ref(m, meta.get("name", ""), reader, namespace, spec.get("env", []))
                     for m in spec.get("models", [])))
