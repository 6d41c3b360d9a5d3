"""spec.disaggregation: prefill and decode pools of a KVInferenceService (issue 43) — the CRD
schema, the parsed form and the checks across the spec. What the pools become is pd_roles.py.

Each pool runs `kvserve serve` with `--kv-transfer-config` of its role (prefill: kv_producer,
decode: kv_consumer, connector KVServeConnector); the router runs `--policy pd`. Both pools
must run the same tensor-parallel size: the connector moves blocks shard to shard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.operator.errors import InvalidSpecError

ROLES = ("prefill", "decode")
WORKLOADS = ("Deployments", "DisaggregatedSet")
# Prefill replicas hold KV only for the prompts in flight (until the decode replica pulls their
# blocks): a few full-length prompts, not a decode batch.
DEFAULT_PREFILL_MAX_NUM_SEQS = 8
DEFAULT_PD_THRESHOLD = 256  # the router's --pd-threshold (service/router/pd.py)
DEFAULT_MAX_PREFILL_QUEUE = 4  # the router's --pd-max-prefill-queue
Schema = dict[str, Any]


def _int(desc: str, **extra: Any) -> Schema:
    return {"type": "integer", "description": desc, **extra}


def _role_autoscaling(role: str) -> Schema:
    props: dict[str, Schema] = {
        "minReplicas": _int("Fewest replicas of the pool.", minimum=1, default=1),
        "maxReplicas": _int("Most replicas of the pool.", minimum=1, maximum=1000),
    }
    if role == "prefill":
        props["targetWaitingRequests"] = _int(
            "Average requests waiting per prefill pod (vllm:num_requests_waiting) the HPA "
            "holds: the prefill queue.", minimum=1, default=2)
        props["targetTTFTSeconds"] = {
            "type": "number", "description": "Average time to first token per prefill pod "
            "(vllm:time_to_first_token_seconds over 2 minutes, through the chart's "
            "prometheus-adapter rule) the HPA holds; unset: queue only.",
            "minimum": 0.001, "maximum": 600}
    else:
        props["targetCacheUsage"] = {
            "type": "number", "description": "Average KV-cache usage per decode pod "
            "(vllm:kv_cache_usage_perc, 0..1) the HPA holds.", "minimum": 0.05,
            "maximum": 1.0, "default": 0.8}
        props["targetWaitingRequests"] = _int(
            "Also scale on waiting requests per decode pod (0: off).", minimum=0, default=0)
    return {"type": "object", "description": f"An HPA on the {role} pool's own Deployment "
            "(Deployments workload only); unset: `replicas` pods.", "properties": props,
            "required": ["maxReplicas"]}


def _role(role: str) -> Schema:
    seqs = (f"Concurrent prompts one prefill replica holds (--max-num-seqs; default "
            f"{DEFAULT_PREFILL_MAX_NUM_SEQS}): its KV cache is sized for this many prompts of "
            "maxModelLen, not for a decode batch." if role == "prefill" else
            "Concurrent requests one decode replica runs (--max-num-seqs; default "
            "spec.engine.maxNumSeqs): its KV cache is sized as a plain replica's.")
    return {"type": "object", "description": f"The {role} pool.", "properties": {
        "replicas": _int("Replicas of the pool (at least 1; the HPA's start with autoscaling).",
                         minimum=0, maximum=1000, default=1),
        "tensorParallelSize": _int(
            "GPUs per replica (tensor parallel). Prefill and decode must agree: the KV "
            "connector moves blocks between equal shards. Unset: what the memory budget needs "
            "(the larger of the two pools' needs).", minimum=1, maximum=64),
        "maxNumSeqs": _int(seqs, minimum=1, maximum=4096),
        "resources": {"type": "object", "description": "The pool's core/v1 "
                      "ResourceRequirements (default spec.resources); GPUs are added.",
                      "x-kubernetes-preserve-unknown-fields": True},
        "autoscaling": _role_autoscaling(role),
    }, "default": {}}


def schema() -> Schema:
    """The openAPIV3Schema of spec.disaggregation."""
    return {"type": "object", "description": (
        "Prefill/decode disaggregation: separate prefill and decode pools, the prompt's KV "
        "blocks moved from a prefill replica to a decode replica (KVServeConnector), the "
        "router in `pd` mode. spec.replicas and spec.autoscaling do not apply; each pool has "
        "its own. docs/guides/disaggregation.md."), "properties": {
        "workload": {"type": "string", "description": (
            "Deployments: one Deployment per pool (labels kvserve.io/role=prefill|decode). "
            "DisaggregatedSet: one sigs.k8s.io/lws DisaggregatedSet "
            "(disaggregatedset.x-k8s.io/v1; the LWS controller with that CRD must be "
            "installed) holding both pools."), "enum": list(WORKLOADS),
            "default": "Deployments"},
        "threshold": _int("Uncached prompt tokens above which the router has a prefill "
                          "replica prefill (router --pd-threshold).", minimum=0,
                          default=DEFAULT_PD_THRESHOLD),
        "maxPrefillQueue": _int("Requests running + waiting on a prefill replica above which "
                                "the decode replica prefills locally "
                                "(router --pd-max-prefill-queue).", minimum=0,
                                default=DEFAULT_MAX_PREFILL_QUEUE),
        "prefill": _role("prefill"),
        "decode": _role("decode"),
    }}


@dataclass(frozen=True)
class RoleAutoscaling:
    min_replicas: int
    max_replicas: int
    target_waiting_requests: int = 0
    target_ttft_seconds: float | None = None  # prefill
    target_cache_usage: float | None = None  # decode


@dataclass(frozen=True)
class RoleSpec:
    name: str  # prefill | decode
    replicas: int
    tensor_parallel_size: int | None
    max_num_seqs: int | None
    resources: dict | None
    autoscaling: RoleAutoscaling | None

    @property
    def kv_role(self) -> str:
        """vLLM's kv_role of the pool's --kv-transfer-config."""
        return "kv_producer" if self.name == "prefill" else "kv_consumer"


@dataclass(frozen=True)
class Disaggregation:
    prefill: RoleSpec
    decode: RoleSpec
    workload: str = "Deployments"
    threshold: int = DEFAULT_PD_THRESHOLD
    max_prefill_queue: int = DEFAULT_MAX_PREFILL_QUEUE

    @property
    def roles(self) -> tuple[RoleSpec, RoleSpec]:
        return self.prefill, self.decode

    @property
    def disaggregated_set(self) -> bool:
        return self.workload == "DisaggregatedSet"


def _autoscaling(name: str, a: dict | None) -> RoleAutoscaling | None:
    if a is None:
        return None
    if a["minReplicas"] > a["maxReplicas"]:
        raise InvalidSpecError(
            f"spec.disaggregation.{name}.autoscaling.minReplicas {a['minReplicas']} is above "
            f"maxReplicas {a['maxReplicas']}", reason="InvalidDisaggregation")
    return RoleAutoscaling(a["minReplicas"], a["maxReplicas"],
                           a.get("targetWaitingRequests", 0), a.get("targetTTFTSeconds"),
                           a.get("targetCacheUsage"))


def _role_spec(name: str, r: dict) -> RoleSpec:
    if r["replicas"] < 1 and r.get("autoscaling") is None:
        raise InvalidSpecError(
            f"spec.disaggregation.{name}.replicas is 0: a disaggregated service needs at least "
            "one prefill and one decode replica (remove spec.disaggregation to serve with "
            "plain replicas)", reason="InvalidDisaggregation")
    return RoleSpec(name, r["replicas"], r.get("tensorParallelSize"), r.get("maxNumSeqs"),
                    r.get("resources"), _autoscaling(name, r.get("autoscaling")))


def parse(raw: dict | None) -> Disaggregation | None:
    """spec.disaggregation (defaulted and schema-checked by parse_spec) as a Disaggregation;
    InvalidSpecError (reason InvalidDisaggregation) says what to fix."""
    if raw is None:
        return None
    prefill, decode = _role_spec("prefill", raw["prefill"]), _role_spec("decode", raw["decode"])
    p, d = prefill.tensor_parallel_size, decode.tensor_parallel_size
    if p is not None and d is not None and p != d:
        raise InvalidSpecError(
            f"spec.disaggregation: prefill.tensorParallelSize {p} != decode.tensorParallelSize "
            f"{d}; the KV connector moves blocks between equal tensor-parallel shards: set "
            "both to the same value (or leave one unset)", reason="InvalidDisaggregation")
    if raw["workload"] == "DisaggregatedSet" and any(r.autoscaling for r in (prefill, decode)):
        raise InvalidSpecError(
            "spec.disaggregation.workload DisaggregatedSet: per-pool autoscaling is rendered "
            "for the Deployments workload only; drop prefill/decode.autoscaling or use "
            "workload Deployments", reason="InvalidDisaggregation")
    return Disaggregation(prefill, decode, raw["workload"], raw["threshold"],
                          raw["maxPrefillQueue"])


def check(dis: Disaggregation, *, autoscaling: bool, router_enabled: bool,
          inference_pool: bool, adapters: bool) -> None:
    """Refuse what spec.disaggregation cannot be combined with (yet)."""
    problems = []
    if autoscaling:
        problems.append("spec.autoscaling scales plain replicas: use "
                        "spec.disaggregation.prefill/decode.autoscaling")
    if inference_pool:
        problems.append("spec.routing.mode inferencePool: the endpoint picker does not split "
                        "prefill from decode; use the router (mode router)")
    elif not router_enabled:
        problems.append("spec.router.enabled false: the router is what sends prompts to the "
                        "prefill pool (policy pd); enable it")
    if adapters:
        problems.append("spec.adapters: LoRA adapters are not synced to prefill/decode pools "
                        "yet; remove them or spec.disaggregation")
    if problems:
        raise InvalidSpecError("spec.disaggregation: " + "; ".join(problems),
                               reason="InvalidDisaggregation")
