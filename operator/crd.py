"""The KVInferenceService CRD, built here once; manifests/crd.yaml and the chart's copy are output.

`python -m kvserve.operator.crd > manifests/crd.yaml` regenerates it (tests check both copies).
"""

from __future__ import annotations

import sys
from typing import Any

from kvserve.engine.defaults import (BLOCK_SIZE, BLOCK_SIZES, GPU_MEMORY_UTILIZATION, GPUS_PER_NODE,
                                     MAX_LORA_RANK, MAX_NUM_SEQS, SWAP_SPACE_GIB)
from kvserve.engine.sizing.parallel_layout import DEFAULT_TARGET_CONCURRENCY
from kvserve.lora.config import MAX_LORA_RANKS
from kvserve.operator import disaggregation
from kvserve.operator.catalog import GPUS

GROUP = "kvserve.io"
VERSION = "v1alpha1"
KIND = "KVInferenceService"
PLURAL = "kvinferenceservices"
SINGULAR = "kvinferenceservice"
SHORT_NAMES = ["kvis"]
API_VERSION = f"{GROUP}/{VERSION}"
DEFAULT_IMAGE = "ghcr.io/kvserve/kvserve:0.1.0"
MAX_GPUS_PER_REPLICA = 128  # 16 nodes of 8

Schema = dict[str, Any]


def _typed(kind: str, desc: str, **extra: Any) -> Schema:
    return {"type": kind, "description": desc, **extra}


def _obj(desc: str, props: dict[str, Schema], **extra: Any) -> Schema:
    return {"type": "object", "description": desc, "properties": props, **extra}


def _free_obj(desc: str) -> Schema:
    return {"type": "object", "description": desc, "x-kubernetes-preserve-unknown-fields": True}


def _model() -> Schema:
    arch = _obj("Shape of a model outside the built-in catalog (from its config.json).", {
        "layers": _typed("integer", "num_hidden_layers.", minimum=1),
        "kvHeads": _typed("integer", "num_key_value_heads.", minimum=1),
        "headDim": _typed("integer", "head_dim (hidden_size / num_attention_heads).", minimum=1),
        "parameters": _typed("integer", "Parameter count (weights bytes = parameters x dtype "
                             "bytes).", format="int64", minimum=1),
        "dtype": _typed("string", "Checkpoint dtype (informational: the engine runs "
                        "engine.dtype).", enum=["float32", "float16", "bfloat16"],
                        default="bfloat16"),
        "heads": _typed("integer", "num_attention_heads (default: kvHeads).", minimum=1),
        "hiddenSize": _typed("integer", "hidden_size (default: heads x headDim).", minimum=1),
        "intermediateSize": _typed("integer", "intermediate_size (default: 4 x hiddenSize).",
                                   minimum=1),
        "vocabSize": _typed("integer", "vocab_size (default 32000).", minimum=1),
        "maxModelLen": _typed("integer", "The model's context length (default 4096).", minimum=1),
    }, required=["layers", "kvHeads", "headDim", "parameters"])
    return _obj("The model to serve: a catalog `name` or a `uri` the engine can load. A model "
                "outside the catalog is sized from its own config.json and safetensors headers "
                "(read from HF_ENDPOINT at reconcile time).", {
        "name": _typed("string", "Catalog name (llama-3.1-8b, qwen3-32b, gpt-oss-120b, "
                       "gemma-3-27b, smollm2-135m, ...), a hub id ORG/NAME, or any name when "
                       "`uri` or `architecture` is given.",
                       minLength=1),
        "uri": _typed("string", "Where the weights come from, spelled as KServe's storageUri: "
                      "hf://ORG/NAME[:REVISION] (the Hugging Face hub), pvc://CLAIM/PATH (an "
                      "existing claim that already holds the weights, mounted read-only), or a "
                      "bare hub id ORG/NAME or local path. s3://BUCKET/PATH is planned, not "
                      "supported yet: the engine image ships no S3 client, so copy the weights "
                      "to a claim and use pvc://. Default: the catalog entry's id.", minLength=1),
        "revision": _typed("string", "Hub revision (branch, tag or commit) to serve; default: "
                           "the :REVISION of an hf:// uri, else main.", minLength=1),
        "cache": _cache(),
        "servedModelName": _typed("string", "Name clients use in requests (default: name, "
                                  "else the resource's name).", minLength=1),
        "architecture": arch,
        "tokenSecretRef": _obj(
            "A Secret key (in the service's namespace) holding a Hugging Face token, for gated "
            "or private models: the operator reads it to size the model from its files, and "
            "the engine, router and fetch pods get it as env HF_TOKEN.", {
                "name": _typed("string", "Secret name.", minLength=1),
                "key": _typed("string", "Key in the Secret.", default="token", minLength=1),
            }, required=["name"]),
    }, **{"x-kubernetes-validations": [
        {"rule": "has(self.name) || has(self.uri)", "message": "set model.name or model.uri"}]})


def _cache() -> Schema:
    pvc = _obj("A claim the operator creates (and keeps when the cache is switched off; it "
               "is deleted with the service).", {
                   "storageClassName": _typed("string", "Storage class (default: the "
                                              "cluster's default class).", minLength=1),
                   "size": _typed("string", "Claim size; leave room for a new revision.",
                                  default="100Gi", pattern=r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$"),
                   "accessMode": _typed("string", "ReadWriteMany: one claim serves every "
                                        "replica on any node. ReadWriteOnce: replicas share it "
                                        "only on one node (see docs/guides/deploying.md).",
                                        enum=["ReadWriteMany", "ReadWriteOnce"],
                                        default="ReadWriteMany"),
               })
    return _obj("A persistent weights cache: an init container runs `kvserve fetch-model` into "
                "it only when its marker file (revision and checksum) is missing or stale, so "
                "later pods and scale-ups start from the cache; the engine mounts it read-only.",
                {"claimName": _typed("string", "An existing PersistentVolumeClaim to use.",
                                     minLength=1),
                 "pvc": pvc},
                **{"x-kubernetes-validations": [
                    {"rule": "has(self.claimName) != has(self.pvc)",
                     "message": "set exactly one of cache.claimName and cache.pvc"}]})


def _engine() -> Schema:
    return _obj("Engine knobs, passed to `kvserve serve` with vLLM's flag names.", {
        "blockSize": _typed("integer", "Tokens per KV-cache block.", enum=list(BLOCK_SIZES),
                            default=BLOCK_SIZE),
        "maxModelLen": _typed("integer", "Longest prompt + output in tokens (default: the "
                              "model's context length).", minimum=16, maximum=1048576),
        "maxNumSeqs": _typed("integer", "Sequences per step. Sizing reserves KV for maxNumSeqs "
                             f"x maxModelLen; unset: the engine default ({MAX_NUM_SEQS}) runs "
                             "and status reports how many full-length requests fit.", minimum=1,
                             maximum=4096),
        "gpuMemoryUtilization": _typed("number", "Share of device memory the engine may use.",
                                       minimum=0.05, maximum=1.0, default=GPU_MEMORY_UTILIZATION),
        "kvCacheDtype": _typed("string", "KV cache dtype; fp8 halves the bytes per block.",
                               enum=["auto", "fp8", "fp8_e4m3", "float16", "bfloat16",
                                     "float32"], default="auto"),
        "enablePrefixCaching": _typed("boolean", "Reuse KV blocks of shared prefixes.",
                                      default=True),
        "swapSpaceGiB": _typed("number", "CPU memory (GiB) for swapped-out blocks.", minimum=0,
                               maximum=1024, default=int(SWAP_SPACE_GIB)),  # whole: 4, not 4.0
        "dtype": _typed("string", "Weights and activations dtype (auto: bfloat16 on GPUs, "
                        "float32 on CPUs).",
                        enum=["auto", "float32", "float16", "bfloat16"], default="auto"),
        "kvOffloading": _kv_offloading(),
        "lora": _obj("LoRA adapters on the replicas (--enable-lora --max-loras --max-lora-rank, "
                     "and runtime loading). On whenever spec.adapters is not empty; enable it "
                     "up front so the first adapter added later needs no pod restart.", {
            "enabled": _typed("boolean", "Serve LoRA adapters even while spec.adapters is "
                              "empty.", default=False),
            "maxLoras": _typed("integer", "Adapters one step may mix (resident in device "
                               "memory; the least recently used idle one is evicted).",
                               minimum=1, maximum=256, default=4),
            "maxLoraRank": _typed("integer", "Largest adapter rank the replicas accept.",
                                  enum=[r for r in MAX_LORA_RANKS if r >= 8],
                                  default=MAX_LORA_RANK),
        }, default={}),
    }, default={})


def _kv_offloading() -> Schema:
    return _obj("Tiers for prefix-cache blocks evicted from device memory (--kv-offloading-*).", {
        "hostGiB": _typed("number", "Host memory (GiB) for evicted blocks; added to the pod's "
                          "memory request and limit. Needs enablePrefixCaching.", minimum=0,
                          maximum=4096),
        "diskGiB": _typed("number", "Disk (GiB) for blocks the host tier evicts: an emptyDir "
                          "with this sizeLimit, or diskClaimName. Needs hostGiB.", minimum=0,
                          maximum=65536),
        "diskClaimName": _typed("string", "An existing PersistentVolumeClaim for the disk tier "
                                "instead of an emptyDir (one engine replica only).",
                                minLength=1),
    }, **{"x-kubernetes-validations": [
        {"rule": "!has(self.diskGiB) || self.diskGiB == 0.0 || "
                 "(has(self.hostGiB) && self.hostGiB > 0.0)",
         "message": "kvOffloading.diskGiB needs hostGiB > 0 (the disk tier keeps what the "
                    "host tier evicts)"}]})


def _gpu() -> Schema:
    return _obj("Accelerator of each replica.", {
        "type": _typed("string", "GPU type from the catalog.", enum=sorted(GPUS)),
        "memoryGiB": _typed("number", "Memory per GPU in GiB, for a type outside the catalog "
                            "(overrides type's figure).", minimum=1, maximum=4096),
        "maxPerReplica": _typed("integer", "Most GPUs one replica may use (tensor parallel x "
                                "pipeline parallel); unset: as many as the sizing needs, up to "
                                f"{MAX_GPUS_PER_REPLICA}.", minimum=1,
                                maximum=MAX_GPUS_PER_REPLICA),
        "perNode": _typed("integer", "GPUs per node (default: the GPU type's usual node, "
                          f"{GPUS_PER_NODE}). Tensor parallel stays within a node; a replica "
                          "needing more GPUs spans nodes with pipeline parallel, as a "
                          "LeaderWorkerSet (leaderworkerset.x-k8s.io/v1).", minimum=1,
                          maximum=64),
    }, default={})


def _sizing() -> Schema:
    return _obj("What the replicas are sized for.", {
        "targetConcurrency": _typed(
            "integer", "Concurrent requests of maxModelLen tokens the service must hold: the "
            "operator picks tensor parallel, pipeline parallel and the replica count that hold "
            "them at the fewest GPUs, and runs at least that many replicas (spec.replicas and "
            "autoscaling.maxReplicas still bound it). Unset: the layout is planned for "
            f"{DEFAULT_TARGET_CONCURRENCY} requests and spec.replicas replicas run.",
            minimum=1, maximum=1000000),
    })


def _autoscaling() -> Schema:
    return _obj("HPA (or KEDA) on KV-cache usage and waiting requests; spec.replicas is then "
                "its target.", {
        "engine": _typed("string", "hpa: an autoscaling/v2 HPA on custom metrics served by "
                         "prometheus-adapter; keda: a KEDA ScaledObject with Prometheus "
                         "triggers (no adapter needed).", enum=["hpa", "keda"], default="hpa"),
        "prometheusAddress": _typed("string", "Prometheus URL the KEDA triggers query.",
                                    default="http://prometheus-operated.monitoring.svc:9090",
                                    pattern="^https?://"),
        "minReplicas": _typed("integer", "Fewest replicas.", minimum=1, default=1),
        "maxReplicas": _typed("integer", "Most replicas.", minimum=1, maximum=1000),
        "targetCacheUsage": _typed("number", "Average vllm:kv_cache_usage_perc (0-1) to hold.",
                                   minimum=0.05, maximum=1.0, default=0.8),
        "targetWaitingRequests": _typed("integer", "Average waiting requests per replica to "
                                        "hold; 0 leaves this metric out.", minimum=0,
                                        default=4),
    }, required=["maxReplicas"])


def _router_redis() -> dict[str, Schema]:
    return {
        "router": _obj("The prefix-aware router in front of the replicas.", {
            "enabled": _typed("boolean", "Deploy the router.", default=True),
            "policy": _typed("string", "Routing policy.", default="prefix",
                             enum=["prefix", "least-load", "round-robin", "session"]),
            "replicas": _typed("integer", "Router pods (they share the Redis index).",
                               minimum=1, maximum=100, default=1),
        }, default={}),
        "redis": _obj("The prefix index: an existing Redis `url`, or one deployed per service.", {
            "url": _typed("string", "URL of an existing Redis (wins over deploy): "
                          "redis://HOST:PORT/DB, rediss://..., "
                          "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER_NAME or "
                          "redis+cluster://HOST:PORT[,HOST:PORT...]; without a password (one "
                          "in the URL is refused: use passwordSecretRef).",
                          pattern=r"^(rediss?|redis\+sentinel|redis\+cluster)://"),
            "deploy": _typed("boolean", "Deploy a Redis for this service when url is unset.",
                             default=True),
            "passwordSecretRef": _obj(
                "A Secret key (in the service's namespace) holding the Redis password: replicas "
                "and routers get it as env KVSERVE_REDIS_PASSWORD; a Redis the operator deploys "
                "requires it.", {
                    "name": _typed("string", "Secret name.", minLength=1),
                    "key": _typed("string", "Key in the Secret.", default="password",
                                  minLength=1),
                }, required=["name"]),
        }, default={}),
        "networkPolicy": _network_policy(),
    }


def _routing() -> Schema:
    return _obj("How traffic picks a replica: kvserve's own router, or a Gateway API Inference "
                "Extension InferencePool whose endpoint picker is `kvserve epp`.", {
        "mode": _typed("string", "router: the prefix-aware router Deployment in front of the "
                       "replicas. inferencePool: no router Deployment; an InferencePool "
                       "(inference.networking.k8s.io/v1) of the replicas, the `kvserve epp` "
                       "endpoint picker (Deployment, Service, RBAC) that a conformant gateway "
                       "asks per request, and, with gateway.parentRefs, an HTTPRoute to the "
                       "pool.", enum=["router", "inferencePool"], default="router"),
        "failureMode": _typed("string", "inferencePool: what the gateway does when the endpoint "
                              "picker does not answer: FailClose refuses the request, FailOpen "
                              "sends it to a replica of its own choosing.",
                              enum=["FailOpen", "FailClose"], default="FailClose"),
        "eppReplicas": _typed("integer", "inferencePool: endpoint picker pods.", minimum=1,
                              maximum=20, default=1),
        "secureServing": _typed("boolean", "inferencePool: the endpoint picker serves ext_proc "
                                "over TLS with a self-signed certificate (`--secure-serving`), as "
                                "Istio's gateway expects (with a DestinationRule that skips "
                                "verification; see the gateway guide). Its gRPC health port "
                                "stays plaintext for the kubelet's probes.", default=False),
    }, default={})


def _network_policy() -> Schema:
    peer = _free_obj("A networking.k8s.io/v1 NetworkPolicyPeer (podSelector, "
                     "namespaceSelector, ipBlock).")
    return _obj("NetworkPolicies (ingress): clients -> router -> engine replicas, only they "
                "reach the service's own Redis, Prometheus scrapes /metrics.", {
        "enabled": _typed("boolean", "Create the NetworkPolicies.", default=True),
        "clients": _typed("array", "Who may call the entry port (the router, or the engines "
                          "when the router is off); empty: any pod or address.", items=peer),
        "prometheus": _typed("array", "Who may scrape /metrics (port 8000) of engine and "
                             "router pods.", items=peer, default=[{"namespaceSelector": {
                                 "matchLabels": {
                                     "kubernetes.io/metadata.name": "monitoring"}}}]),
    }, default={})


def _traffic() -> dict[str, Schema]:
    string_map = {"type": "object", "additionalProperties": {"type": "string"}}
    parent = _obj("A Gateway API ParentReference (usually a Gateway).", {
        "name": _typed("string", "Name of the Gateway.", minLength=1),
        "namespace": _typed("string", "Its namespace (default: the service's).", minLength=1),
        "sectionName": _typed("string", "A listener of the Gateway.", minLength=1),
        "group": _typed("string", "Default gateway.networking.k8s.io."),
        "kind": _typed("string", "Default Gateway.", minLength=1),
        "port": _typed("integer", "A listener port.", minimum=1, maximum=65535),
    }, required=["name"])
    return {
        "ingress": _obj("An Ingress in front of the entry Service (the router, or the engine "
                        "when the router is off).", {
            "host": _typed("string", "Host name clients use.", minLength=1),
            "className": _typed("string", "ingressClassName (default: the cluster's).",
                                minLength=1),
            "tlsSecretName": _typed("string", "A kubernetes.io/tls Secret for the host.",
                                    minLength=1),
            "path": _typed("string", "Path prefix routed to the service.", default="/",
                           pattern="^/"),
            "annotations": {**string_map, "description": "Ingress annotations (timeouts for "
                            "streaming responses, cert-manager issuer, ...)."},
        }, required=["host"]),
        "gateway": _obj("A Gateway API HTTPRoute (gateway.networking.k8s.io/v1) attaching the "
                        "entry Service to existing Gateways.", {
            "parentRefs": _typed("array", "Gateways to attach to.", items=parent, minItems=1,
                                 maxItems=32),
            "hostnames": _typed("array", "Host names the route answers.", maxItems=16,
                                items=_typed("string", "A host name (wildcards as *.example.com).",
                                              minLength=1)),
        }, required=["parentRefs"]),
        "monitoring": _obj("prometheus-operator scrape objects for engine and router pods.", {
            "serviceMonitor": _typed("boolean", "A ServiceMonitor (monitoring.coreos.com/v1).",
                                     default=False),
            "podMonitor": _typed("boolean", "A PodMonitor (monitoring.coreos.com/v1).",
                                 default=False),
            "interval": _typed("string", "Scrape interval.", default="15s",
                               pattern="^[0-9]+(ms|s|m)$"),
            "labels": {**string_map, "description": "Labels your Prometheus selects monitors "
                       "by (e.g. release: prometheus)."},
        }, default={}),
    }


def _pod() -> dict[str, Schema]:
    return {
        "image": _typed("string", "Engine and router image.", default=DEFAULT_IMAGE, minLength=1),
        "resources": _free_obj("Extra engine container resources (cpu, memory); the operator "
                               "sets nvidia.com/gpu itself."),
        "nodeSelector": _typed("object", "Engine pod node selector.",
                               additionalProperties={"type": "string"}),
        "tolerations": _typed("array", "Engine pod tolerations.",
                              items=_free_obj("A core/v1 Toleration.")),
        "env": _typed("array", "Extra engine environment variables.",
                      items=_free_obj("A core/v1 EnvVar.")),
    }


def _adapters() -> Schema:
    adapter = _obj("A LoRA adapter (a PEFT folder: adapter_config.json + "
                   "adapter_model.safetensors) of the served model.", {
        "name": _typed("string", "The name requests select it by (`model`).", minLength=1,
                       maxLength=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"),
        "uri": _typed("string", "Where it is: hf://ORG/NAME[:REVISION] or a hub id (fetched "
                      "into the weights cache, spec.model.cache), pvc://CLAIM/PATH on the "
                      "model's own claim, or an absolute path inside the image.", minLength=1),
    }, required=["name", "uri"])
    return _typed("array", "LoRA adapters of the model. Adding or removing one loads or unloads "
                  "it on the running replicas (no restart); the router loads a registered "
                  "adapter on demand. status.adapters says where each one is loaded.",
                  items=adapter, maxItems=256,
                  **{"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})


def spec_schema() -> Schema:
    """The openAPIV3Schema of `spec` (defaults, enums, ranges, descriptions)."""
    props: dict[str, Schema] = {
        "model": _model(),
        "engine": _engine(),
        "device": _typed("string", "cuda: GPU replicas sized by the memory budget; cpu: for "
                         "kind clusters (sized by resources.limits.memory).",
                         enum=["cuda", "cpu"], default="cuda"),
        "gpu": _gpu(),
        "sizing": _sizing(),
        "adapters": _adapters(),
        "models": _typed("array", "More small models served by each replica beside spec.model, "
                         "every one under its servedModelName (default: name) on the same port, "
                         "all over one shared KV pool (kvserve serve --additional-model). "
                         "Placed only when sizing says they fit one GPU with spec.model (their "
                         "weights come out of its KV budget; spec.model must have the largest "
                         "KV block); else the service gets a condition and no workload. Each "
                         "loads from the hub (a catalog name, a hub id or hf://).",
                         items=_model(), maxItems=16),
        "replicas": _typed("integer", "Engine replicas (the HPA's target when autoscaling).",
                           minimum=0, maximum=1000, default=1),
        "autoscaling": _autoscaling(),
        "disaggregation": disaggregation.schema(),
        **_router_redis(),
        "routing": _routing(),
        **_traffic(),
        **_pod(),
    }
    return _obj("Desired state of a KVInferenceService.", props, required=["model"])


def status_schema() -> Schema:
    sizing = _obj("What the memory budget chose (as `kvserve plan --output json`).", {
        "gpusPerReplica": _typed("integer", "GPUs per replica (tensorParallelSize x "
                                 "pipelineParallelSize)."),
        "tensorParallelSize": _typed("integer", "Tensor-parallel ranks (within a node)."),
        "pipelineParallelSize": _typed("integer", "Pipeline stages (across nodes)."),
        "nodesPerReplica": _typed("integer", "Pods (nodes) per replica: above 1, a "
                                  "LeaderWorkerSet group."),
        "gpusPerNode": _typed("integer", "GPUs each pod of a replica uses."),
        "targetConcurrency": _typed("integer", "The concurrency target it was sized for."),
        "replicasForTarget": _typed("integer", "Replicas that hold the target."),
        "alternatives": _typed("array", "Layouts not chosen, and why.",
                               items={"type": "object",
                                      "x-kubernetes-preserve-unknown-fields": True}),
        "warnings": _typed("array", "Latency or bandwidth caveats of the chosen layout.",
                           items={"type": "string"}),
        "weightBytes": _typed("integer", "Weight bytes per replica: from the checkpoint's "
                              "safetensors headers when the operator read them (quantised "
                              "tensors at their stored bytes), else parameters x dtype bytes.",
                              format="int64"),
        "kvBytes": _typed("integer", "KV-cache bytes per replica.", format="int64"),
        "bytesPerBlock": _typed("integer", "Bytes per KV block per replica.", format="int64"),
        "numBlocks": _typed("integer", "KV blocks per replica.", format="int64"),
        "maxConcurrency": _typed("integer", "Full-length requests one replica holds at once.",
                                 format="int64"),
        "maxConcurrencyWindowed": _typed(
            "integer", "The same with sliding-window layers (Gemma, gpt-oss, Mistral) holding "
            "only their window.", format="int64"),
        "modelSource": _typed("string", "Where the model's figures came from: catalog, "
                              "spec.model.architecture, or the files read."),
        "explanation": _typed("string", "The arithmetic, in words."),
    }, **{"x-kubernetes-preserve-unknown-fields": True})
    condition = _obj("A status condition.", {
        "type": _typed("string", "Ready, Sized, Applied, Conflict."),
        "status": _typed("string", "True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _typed("string", "CamelCase reason."),
        "message": _typed("string", "What happened and what to change."),
        "lastTransitionTime": _typed("string", "When status last changed.", format="date-time"),
        "observedGeneration": _typed("integer", "Generation it describes.", format="int64"),
    }, required=["type", "status"])
    return _obj("Observed state (written by the operator).", {
        "observedGeneration": _typed("integer", "Last generation reconciled.", format="int64"),
        "replicas": _typed("integer", "Engine replicas running."),
        "readyReplicas": _typed("integer", "Engine replicas ready."),
        "selector": _typed("string", "Label selector of the engine pods (for the HPA)."),
        "sizing": sizing,
        "lastApplied": _obj("The operator's last change to the children.", {
            "time": _typed("string", "When it applied them.", format="date-time"),
            "generation": _typed("integer", "The generation it applied.", format="int64"),
            "applied": _typed("array", "Kind/name of each object applied (server-side).",
                              items={"type": "string"}),
            "deleted": _typed("array", "Kind/name of each object deleted.",
                              items={"type": "string"}),
        }),
        "adapters": _typed("array", "Each adapter of spec.adapters and the engine pods that "
                           "hold it now.", items=_obj("Where one adapter is loaded.", {
                               "name": _typed("string", "The adapter."),
                               "uri": _typed("string", "Its spec.adapters uri."),
                               "loadedOn": _typed("array", "Engine pods holding it.",
                                                  items={"type": "string"}),
                               "message": _typed("string", "Why it is not loaded everywhere "
                                                 "(a fetch in progress, a pod's refusal)."),
                           })),
        "conditions": _typed("array", "Ready and friends.", items=condition,
                             **{"x-kubernetes-list-type": "map",
                                "x-kubernetes-list-map-keys": ["type"]}),
    }, **{"x-kubernetes-preserve-unknown-fields": True})  # kopf keeps its progress here


def _columns() -> list[dict[str, str]]:
    return [
        {"name": "Ready", "type": "string",
         "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "GPUs/Replica", "type": "integer", "jsonPath": ".status.sizing.gpusPerReplica"},
        {"name": "Max-Concurrency", "type": "integer",
         "jsonPath": ".status.sizing.maxConcurrency"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    schema = {"type": "object", "description": "A model served by paged-KV engine replicas "
              "behind a prefix-aware router.", "properties": {
                  "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                  "metadata": {"type": "object"},
                  "spec": spec_schema(), "status": status_schema()}, "required": ["spec"]}
    version = {
        "name": VERSION, "served": True, "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}, "scale": {
            "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector"}},
        "additionalPrinterColumns": _columns(),
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/part-of": "kvserve"}},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                           "singular": SINGULAR, "shortNames": SHORT_NAMES,
                           "categories": ["kvserve"]},
                 "versions": [version]},
    }


def crd_yaml() -> str:
    import yaml

    header = "# Generated by `python -m kvserve.operator.crd`; do not edit by hand.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(crd_yaml())
