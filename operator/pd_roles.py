"""What spec.disaggregation becomes (operator/disaggregation.py holds the spec): each pool sized by
the memory budget for its role, rendered as a Deployment labelled kvserve.io/role=prefill|decode
with its own HPA (prefill on its queue and time to first token, decode on KV-cache usage), or
both pools as one LWS DisaggregatedSet; the router in `pd` mode; the engine NetworkPolicy opened
to the block transfers between pools.

Sizing per role: a prefill replica holds KV only for the prompts in flight until the decode
replica pulls them (`prefill.maxNumSeqs` prompts of maxModelLen, default 8); a decode replica is
sized as a plain replica. Both run at one tensor-parallel size: the one given, else the larger
of the two pools' needs (the other pool then has more KV than its status says)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, replace
from typing import Any

from kvserve.operator import resources as res
from kvserve.operator.disaggregation import DEFAULT_PREFILL_MAX_NUM_SEQS, RoleSpec
from kvserve.operator.errors import InvalidSpecError
from kvserve.operator.quantity import parse_quantity
from kvserve.operator.sizing import Sizing, plan
from kvserve.operator.spec import ServiceSpec

ROLE_LABEL = "kvserve.io/role"
CONNECTOR = "KVServeConnector"  # engine/kv_transfer/kvserve_connector.py
KV_PORT = 5600  # the connector's block server (vLLM's NIXL side-channel port); rank r: +r
DS_API_VERSION = "disaggregatedset.x-k8s.io/v1"
# vllm:time_to_first_token_seconds' mean over 2 minutes per pod, via the chart's
# prometheus-adapter rule (charts/kvserve/templates/prometheus-adapter-rules.yaml).
TTFT_METRIC = "vllm_time_to_first_token_seconds_mean"
Obj = dict[str, Any]


@dataclass(frozen=True)
class RolePlan:
    """One pool: its spec, the service as the pool sees it, its sizing and the common TP."""

    role: RoleSpec
    spec: ServiceSpec
    sizing: Sizing
    tensor_parallel_size: int

    @property
    def name(self) -> str:
        return self.role.name


def role_service(spec: ServiceSpec, role: RoleSpec, tp: int | None) -> ServiceSpec:
    """The service as one pool sees it: the pool's maxNumSeqs, resources and replicas."""
    seqs = role.max_num_seqs or (DEFAULT_PREFILL_MAX_NUM_SEQS if role.name == "prefill"
                                 else spec.engine.max_num_seqs)
    resources = spec.resources if role.resources is None else role.resources
    memory = spec.gpu_memory_bytes
    if spec.device == "cpu" and role.resources is not None:
        limit = role.resources.get("limits", {}).get("memory")
        if limit is None:
            raise InvalidSpecError(f"spec.disaggregation.{role.name}.resources: device cpu is "
                                   "sized by limits.memory; set it", "InvalidDisaggregation")
        memory = parse_quantity(limit)
    return replace(spec, engine=replace(spec.engine, max_num_seqs=seqs), resources=resources,
                   gpu_memory_bytes=memory, replicas=role.replicas, autoscaling=None,
                   max_gpus_per_replica=tp or spec.max_gpus_per_replica)


def _tp(s: Sizing) -> int:
    return getattr(s, "tensor_parallel_size", 0) or max(s.gpus_per_replica, 1)


def _plan_role(spec: ServiceSpec, role: RoleSpec, tp: int | None) -> tuple[ServiceSpec, Sizing]:
    rs = role_service(spec, role, tp)
    try:
        sizing = plan(rs)
    except InvalidSpecError as exc:
        raise InvalidSpecError(f"the {role.name} pool: {exc}", exc.reason) from None
    if getattr(sizing, "pipeline_parallel_size", 1) > 1:
        raise InvalidSpecError(
            f"the {role.name} pool needs pipeline parallel over several nodes; disaggregated "
            "pools run one node per replica: lower maxModelLen/maxNumSeqs or pick bigger GPUs",
            "InvalidDisaggregation")
    return rs, sizing


def plan_roles(spec: ServiceSpec) -> tuple[RolePlan, RolePlan]:
    """(prefill, decode) plans; InvalidSpecError when a pool does not fit."""
    dis = spec.disaggregation
    assert dis is not None
    _connector_model(spec)
    fixed = dis.prefill.tensor_parallel_size or dis.decode.tensor_parallel_size
    sized = [(r, *_plan_role(spec, r, fixed)) for r in dis.roles]
    tp = 1 if spec.device == "cpu" else fixed or max(_tp(s) for _, _, s in sized)
    return tuple(RolePlan(r, rs, s, tp) for r, rs, s in sized)  # type: ignore[return-value]


def _connector_model(spec: ServiceSpec) -> None:
    """Refuse a model whose KV KVServeConnector cannot move: engine/kv_transfer/factory.py
    refuses sliding-window layers at start-up, so its pods would crash-loop."""
    windows = [g for g in spec.model.arch.layer_groups or () if g.window is not None]
    if windows:
        raise InvalidSpecError(
            f"{spec.model.key} has sliding-window layers (window {windows[0].window}), whose "
            "block tables KVServeConnector does not move yet; serve it without "
            "spec.disaggregation", "InvalidDisaggregation")


def status_sizing(plans: tuple[RolePlan, RolePlan]) -> Sizing:
    """status.sizing of a disaggregated service: the decode pool's, both pools in words."""
    prefill, decode = plans
    words = "; ".join(
        f"{p.name} pool ({p.role.replicas} replica(s), tensor parallel "
        f"{p.tensor_parallel_size}, --max-num-seqs {p.sizing.max_num_seqs}): "
        f"{p.sizing.explanation}" for p in plans)
    return replace(decode.sizing, explanation=words)


def role_name(spec: ServiceSpec, role: str) -> str:
    return f"{spec.name}-{role}"


def _labelled(obj: Obj, role: str) -> Obj:
    obj["labels"] = {**obj.get("labels", {}), ROLE_LABEL: role}
    return obj


def _role_args(args: list[str], rp: RolePlan) -> list[str]:
    args = list(args)
    i = args.index("--tensor-parallel-size")
    args[i + 1] = str(rp.tensor_parallel_size)
    config = {"kv_connector": CONNECTOR, "kv_role": rp.role.kv_role,
              "kv_connector_extra_config": {"kv_port": KV_PORT}}
    return args + ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def role_deployment(spec: ServiceSpec, rp: RolePlan) -> Obj:
    """The pool's Deployment: the engine Deployment of its role's service, relabelled, with its
    --kv-transfer-config; no `replicas` when its HPA owns them."""
    dep = res.engine_deployment(rp.spec, rp.sizing)
    dep["metadata"] = _labelled(res.metadata(spec, role_name(spec, rp.name), "engine"), rp.name)
    dep["spec"]["selector"]["matchLabels"][ROLE_LABEL] = rp.name
    template = dep["spec"]["template"]
    _labelled(template["metadata"], rp.name)
    container = template["spec"]["containers"][0]
    container["args"] = _role_args(container["args"], rp)
    if spec.device != "cpu":
        container["resources"].setdefault("limits", {})["nvidia.com/gpu"] = \
            str(rp.tensor_parallel_size)
    if rp.name == "prefill":  # decode replicas pull the blocks from here, each rank its shard
        container["ports"] += [{"name": "kv-transfer" + (f"-{r}" if r else ""),
                                "containerPort": KV_PORT + r, "protocol": "TCP"}
                               for r in range(rp.tensor_parallel_size)]
    if rp.role.autoscaling is not None:
        del dep["spec"]["replicas"]
    return dep


def role_hpa(spec: ServiceSpec, rp: RolePlan) -> Obj | None:
    """The pool's HPA on its own Deployment: prefill on waiting requests (and TTFT), decode on
    KV-cache usage (and waiting requests)."""
    a = rp.role.autoscaling
    if a is None:
        return None
    if rp.name == "prefill":
        metrics = [res.pods_metric(res.WAITING_METRIC, str(a.target_waiting_requests))]
        if a.target_ttft_seconds is not None:
            metrics.append(res.pods_metric(TTFT_METRIC, res.milli(a.target_ttft_seconds)))
    else:
        metrics = [res.pods_metric(res.CACHE_USAGE_METRIC, res.milli(a.target_cache_usage or
                                                                        0.8))]
        if a.target_waiting_requests:
            metrics.append(res.pods_metric(res.WAITING_METRIC, str(a.target_waiting_requests)))
    name = role_name(spec, rp.name)
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _labelled(res.metadata(spec, name, "engine"), rp.name),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name},
                     "minReplicas": a.min_replicas, "maxReplicas": a.max_replicas,
                     "metrics": metrics, "behavior": res.scale_behavior()}}


def disaggregated_set(spec: ServiceSpec, plans: tuple[RolePlan, RolePlan]) -> Obj:
    """Both pools as one sigs.k8s.io/lws DisaggregatedSet: each role a LeaderWorkerSet template
    of groups of one pod (the role Deployment's pod template)."""
    roles = []
    for rp in plans:
        template = role_deployment(spec, rp)["spec"]["template"]
        roles.append({"name": rp.name,
                      "metadata": {"labels": {**res.labels(spec, "engine"),
                                              ROLE_LABEL: rp.name}},
                      "spec": {"replicas": rp.role.replicas,
                               "leaderWorkerTemplate": {"size": 1, "workerTemplate": template}}})
    return {"apiVersion": DS_API_VERSION, "kind": "DisaggregatedSet",
            "metadata": res.metadata(spec, f"{spec.name}-pd", "engine"),
            "spec": {"roles": roles}}


def pool_objects(spec: ServiceSpec, plans: tuple[RolePlan, RolePlan]) -> list[Obj]:
    dis = spec.disaggregation
    assert dis is not None
    if dis.disaggregated_set:
        return [disaggregated_set(spec, plans)]
    out = []
    for rp in plans:
        out.append(role_deployment(spec, rp))
        hpa = role_hpa(spec, rp)
        if hpa is not None:
            out.append(hpa)
    return out


def router_args(spec: ServiceSpec, args: list[str]) -> list[str]:
    """The router's args in pd mode."""
    dis = spec.disaggregation
    assert dis is not None
    args = list(args)
    args[args.index("--policy") + 1] = "pd"
    return args + ["--pd-threshold", str(dis.threshold),
                   "--pd-max-prefill-queue", str(dis.max_prefill_queue)]


def _open_kv_port(policy: Obj, spec: ServiceSpec, tp: int) -> None:
    """Decode pods pull blocks from prefill pods: engine -> engine on KV_PORT (+ rank)."""
    port: Obj = {"protocol": "TCP", "port": KV_PORT}
    if tp > 1:
        port["endPort"] = KV_PORT + tp - 1
    policy["spec"]["ingress"].append(
        {"ports": [port], "from": [{"podSelector": {"matchLabels": res.selector(spec, "engine")}}]})


def disaggregate(spec: ServiceSpec, objects: list[Obj], plans: tuple[RolePlan, RolePlan]
                 ) -> list[Obj]:
    """`objects` (resources.desired_objects of the service) with the engine Deployment replaced
    by the pools, the router in pd mode and the block transfers let through."""
    n = res.names(spec)
    out: list[Obj] = []
    for obj in copy.deepcopy(objects):
        kind, name = obj["kind"], obj["metadata"]["name"]
        if kind == "Deployment" and name == n["engine"]:
            out += pool_objects(spec, plans)
            continue
        if kind == "Deployment" and name == n["router"]:
            container = obj["spec"]["template"]["spec"]["containers"][0]
            container["args"] = router_args(spec, container["args"])
        if kind == "NetworkPolicy" and name == n["engine"]:
            _open_kv_port(obj, spec, plans[0].tensor_parallel_size)
        out.append(obj)
    return out


def readiness_view(spec: ServiceSpec, live: dict[str, Obj]) -> tuple[Obj | None, int]:
    """(a Deployment-shaped sum of the pools' live objects, desired replicas) for status:
    Ready when every pool's replicas are ready."""
    dis = spec.disaggregation
    assert dis is not None
    keys = ([f"DisaggregatedSet/{spec.name}-pd"] if dis.disaggregated_set else
            [f"Deployment/{role_name(spec, r.name)}" for r in dis.roles])
    found = [live.get(k) for k in keys]
    desired = sum(r.replicas for r in dis.roles)
    if any(f is None for f in found):
        return None, desired
    status: dict[str, int] = {"replicas": 0, "readyReplicas": 0, "updatedReplicas": 0}
    for obj in found:
        assert obj is not None
        rows = obj.get("status", {}).get("roleStatuses") or [obj.get("status", {})]
        for row in rows:
            for key in status:
                status[key] += int(row.get(key, 0) or 0)
    return {"status": status}, desired
