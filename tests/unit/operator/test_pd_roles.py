"""spec.disaggregation: the prefill and decode pools (Deployments with their HPAs, or one LWS
DisaggregatedSet), each sized for its role, the router in pd mode, and the specs refused with a
reason and no workload. Every object is checked against its real schema (kubernetes-validate,
the vendored DisaggregatedSet CRD)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from crd_schemas import errors as crd_errors
from kvserve.operator.children import build_children
from kvserve.operator.conditions import readiness
from kvserve.operator.pd_roles import KV_PORT, ROLE_LABEL, TTFT_METRIC, readiness_view
from kvserve.operator.render import render
from kvserve.operator.spec import InvalidSpecError, parse_spec

NS = "ml"


def cr(disaggregation: dict, **spec: Any) -> dict:
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": NS, "uid": "uid-chat"},
            "spec": {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"},
                     "engine": {"maxModelLen": 8192}, "disaggregation": disaggregation,
                     **spec}}


def by_key(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def refused(body: dict) -> InvalidSpecError:
    with pytest.raises(InvalidSpecError) as info:
        build_children(body)
    return info.value


def test_two_role_deployments_replace_the_engine_deployment() -> None:
    objs = by_key(cr({"prefill": {"replicas": 2}, "decode": {"replicas": 3}}))
    assert "Deployment/chat-engine" not in objs
    prefill, decode = objs["Deployment/chat-prefill"], objs["Deployment/chat-decode"]
    for dep, role, replicas, kv_role in ((prefill, "prefill", 2, "kv_producer"),
                                         (decode, "decode", 3, "kv_consumer")):
        kubernetes_validate.validate(dep, "1.31", strict=True)
        assert dep["spec"]["replicas"] == replicas
        assert dep["metadata"]["labels"][ROLE_LABEL] == role
        assert dep["spec"]["selector"]["matchLabels"][ROLE_LABEL] == role
        assert dep["spec"]["template"]["metadata"]["labels"][ROLE_LABEL] == role
        args = container(dep)["args"]
        config = json.loads(flag(args, "--kv-transfer-config"))
        assert config == {"kv_connector": "KVServeConnector", "kv_role": kv_role,
                          "kv_connector_extra_config": {"kv_port": KV_PORT}}
    # the engine Service and the router's static fallback reach both pools
    selector = objs["Service/chat-engine"]["spec"]["selector"]
    for dep in (prefill, decode):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
    assert [p["containerPort"] for p in container(prefill)["ports"]] == [8000, KV_PORT]
    assert [p["containerPort"] for p in container(decode)["ports"]] == [8000]


def test_each_pool_is_sized_for_its_role() -> None:
    objs = by_key(cr({"prefill": {}, "decode": {"maxNumSeqs": 16}}))
    p_args = container(objs["Deployment/chat-prefill"])["args"]
    d_args = container(objs["Deployment/chat-decode"])["args"]
    assert flag(p_args, "--max-num-seqs") == "8"  # a few prompts in flight, not a batch
    assert flag(d_args, "--max-num-seqs") == "16"
    assert flag(p_args, "--tensor-parallel-size") == flag(d_args, "--tensor-parallel-size")
    sizing = json.loads(objs["ConfigMap/chat-config"]["data"]["sizing.json"])
    assert "prefill pool (1 replica(s)" in sizing["explanation"]
    assert "--max-num-seqs 8" in sizing["explanation"]
    assert "decode pool" in sizing["explanation"]


def test_both_pools_run_the_larger_tensor_parallel_size() -> None:
    # 70B at 8k: a decode batch of 32 needs more GPUs than 2 prompts do on the prefill side
    body = cr({"prefill": {"maxNumSeqs": 2}, "decode": {"maxNumSeqs": 32}},
              model={"name": "llama-3-70b"}, gpu={"type": "H100-80GB"})
    own = {}
    for role, seqs in (("prefill", 2), ("decode", 32)):
        plain = {**body, "spec": {**body["spec"], "engine": {"maxModelLen": 8192,
                                                             "maxNumSeqs": seqs}}}
        del plain["spec"]["disaggregation"]
        own[role] = build_children(plain).sizing.gpus_per_replica
    assert own["prefill"] < own["decode"]  # the case this test is about
    objs = by_key(body)
    for role in ("prefill", "decode"):
        c = container(objs[f"Deployment/chat-{role}"])
        assert flag(c["args"], "--tensor-parallel-size") == str(own["decode"])
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(own["decode"])
        kubernetes_validate.validate(objs[f"Deployment/chat-{role}"], "1.31", strict=True)
    # each rank serves its shard on KV_PORT + rank; the policy lets the whole range through
    ports = container(objs["Deployment/chat-prefill"])["ports"][1:]
    assert [p["containerPort"] for p in ports] == [KV_PORT + r for r in range(own["decode"])]
    policy = objs["NetworkPolicy/chat-engine"]
    kubernetes_validate.validate(policy, "1.31", strict=True)
    assert policy["spec"]["ingress"][-1]["ports"] == [
        {"protocol": "TCP", "port": KV_PORT, "endPort": KV_PORT + own["decode"] - 1}]


def test_models_the_connector_cannot_move_are_refused() -> None:
    exc = refused(cr({"prefill": {}, "decode": {}}, model={"name": "gemma-3-27b"},
                     gpu={"type": "H100-80GB"}, engine={"maxModelLen": 4096}))
    assert exc.reason == "InvalidDisaggregation" and "sliding-window" in str(exc)


def test_per_pool_autoscaling_on_its_own_signal() -> None:
    objs = by_key(cr({"prefill": {"autoscaling": {"maxReplicas": 4, "targetTTFTSeconds": 0.5}},
                      "decode": {"autoscaling": {"minReplicas": 2, "maxReplicas": 8,
                                                 "targetCacheUsage": 0.7}}}))
    prefill, decode = objs["HorizontalPodAutoscaler/chat-prefill"], \
        objs["HorizontalPodAutoscaler/chat-decode"]
    for hpa, role in ((prefill, "prefill"), (decode, "decode")):
        kubernetes_validate.validate(hpa, "1.31", strict=True)
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": f"chat-{role}"}
        assert "replicas" not in objs[f"Deployment/chat-{role}"]["spec"]  # the HPA owns it
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in prefill["spec"]["metrics"]}
    assert metrics == {"vllm_num_requests_waiting": "2", TTFT_METRIC: "500m"}
    assert [m["pods"]["metric"]["name"] for m in decode["spec"]["metrics"]] == \
        ["vllm_kv_cache_usage_perc"]
    assert decode["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "700m"
    assert (decode["spec"]["minReplicas"], decode["spec"]["maxReplicas"]) == (2, 8)
    assert "HorizontalPodAutoscaler/chat" not in objs  # no HPA on the CR's own scale


def test_router_runs_pd_and_kv_transfers_are_let_through() -> None:
    objs = by_key(cr({"threshold": 512, "maxPrefillQueue": 2, "prefill": {}, "decode": {}}))
    args = container(objs["Deployment/chat-router"])["args"]
    assert (flag(args, "--policy"), flag(args, "--pd-threshold"),
            flag(args, "--pd-max-prefill-queue")) == ("pd", "512", "2")
    policy = objs["NetworkPolicy/chat-engine"]
    kubernetes_validate.validate(policy, "1.31", strict=True)
    kv = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == KV_PORT]
    assert kv == [{"ports": [{"protocol": "TCP", "port": KV_PORT}],
                   "from": [{"podSelector": {"matchLabels": {
                       "app.kubernetes.io/instance": "chat",
                       "app.kubernetes.io/component": "engine"}}}]}]


def test_disaggregated_set_validates_against_the_lws_crd() -> None:
    objs = by_key(cr({"workload": "DisaggregatedSet", "prefill": {"replicas": 1},
                      "decode": {"replicas": 2}}))
    assert not any(k.startswith("Deployment/chat-") and k != "Deployment/chat-router"
                   and k != "Deployment/chat-redis" for k in objs)
    ds = objs["DisaggregatedSet/chat-pd"]
    assert crd_errors(ds) == []
    roles = {r["name"]: r for r in ds["spec"]["roles"]}
    assert {n: r["spec"]["replicas"] for n, r in roles.items()} == {"prefill": 1, "decode": 2}
    # the CRD's CEL rule: every Static role's replicas non-zero (or every one zero)
    assert all(r["spec"]["replicas"] > 0 for r in roles.values())
    for name, role in roles.items():
        template = role["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                      "metadata": {"name": f"chat-{name}"},
                                      "template": template}, "1.31", strict=True)
        assert template["metadata"]["labels"][ROLE_LABEL] == name
        assert role["spec"]["leaderWorkerTemplate"]["size"] == 1
        args = template["spec"]["containers"][0]["args"]
        assert json.loads(flag(args, "--kv-transfer-config"))["kv_role"] == \
            {"prefill": "kv_producer", "decode": "kv_consumer"}[name]


@pytest.mark.parametrize("disaggregation, extra, words", [
    ({"prefill": {"tensorParallelSize": 2}, "decode": {"tensorParallelSize": 4}}, {},
     "prefill.tensorParallelSize 2 != decode.tensorParallelSize 4"),
    ({"prefill": {"replicas": 0}, "decode": {}}, {}, "prefill.replicas is 0"),
    ({"prefill": {}, "decode": {"replicas": 0}}, {}, "decode.replicas is 0"),
    ({"prefill": {}, "decode": {}}, {"autoscaling": {"maxReplicas": 4}}, "spec.autoscaling"),
    ({"prefill": {}, "decode": {}}, {"routing": {"mode": "inferencePool"}}, "inferencePool"),
    ({"prefill": {}, "decode": {}}, {"router": {"enabled": False}}, "router.enabled false"),
    ({"workload": "DisaggregatedSet", "prefill": {"autoscaling": {"maxReplicas": 2}},
      "decode": {}}, {}, "per-pool autoscaling"),
    ({"prefill": {"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "decode": {}}, {},
     "minReplicas 3 is above maxReplicas 2"),
])
def test_invalid_disaggregation_is_refused_with_a_reason(disaggregation: dict, extra: dict,
                                                          words: str) -> None:
    exc = refused(cr(disaggregation, **extra))
    assert exc.reason == "InvalidDisaggregation"
    assert words in str(exc)


def test_a_pool_that_does_not_fit_names_itself() -> None:
    exc = refused(cr({"prefill": {"tensorParallelSize": 1}, "decode": {}},
                     model={"name": "llama-3-70b"}))
    assert exc.reason == "InsufficientGPUMemory" and str(exc).startswith("the prefill pool: ")


def test_schema_refuses_unknown_fields_and_workloads() -> None:
    with pytest.raises(InvalidSpecError, match="spec.disaggregation.prefill.gpus: unknown"):
        parse_spec(cr({"prefill": {"gpus": 2}, "decode": {}}))
    with pytest.raises(InvalidSpecError, match="spec.disaggregation.workload"):
        parse_spec(cr({"workload": "StatefulSet", "prefill": {}, "decode": {}}))


def test_no_disaggregation_leaves_the_service_as_it_was() -> None:
    body = cr({})
    del body["spec"]["disaggregation"]
    assert parse_spec(body).disaggregation is None
    objs = by_key(body)
    assert "Deployment/chat-engine" in objs and "Deployment/chat-prefill" not in objs


def test_cpu_pools_take_their_memory_from_their_own_resources() -> None:
    body = cr({"prefill": {"resources": {"limits": {"memory": "3Gi"}}},
               "decode": {"resources": {"limits": {"memory": "6Gi"}}}},
              model={"name": "smollm2-135m"}, device="cpu",
              resources={"limits": {"memory": "4Gi"}}, engine={"maxModelLen": 2048})
    objs = by_key(body)
    for role, memory in (("prefill", "3Gi"), ("decode", "6Gi")):
        c = container(objs[f"Deployment/chat-{role}"])
        assert c["resources"]["limits"]["memory"] == memory
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
    kv = {role: int(flag(container(objs[f"Deployment/chat-{role}"])["args"],
                         "--kv-cache-memory")) for role in ("prefill", "decode")}
    assert kv["decode"] > kv["prefill"] > 0


def test_readiness_counts_every_replica_of_both_pools() -> None:
    spec = parse_spec(cr({"prefill": {"replicas": 1}, "decode": {"replicas": 2}}))
    live = {"Deployment/chat-prefill": {"status": {"replicas": 1, "readyReplicas": 1,
                                                   "updatedReplicas": 1}},
            "Deployment/chat-decode": {"status": {"replicas": 2, "readyReplicas": 1,
                                                  "updatedReplicas": 2}}}
    assert readiness(*readiness_view(spec, live)).condition.status == "False"
    live["Deployment/chat-decode"]["status"]["readyReplicas"] = 2
    ready = readiness(*readiness_view(spec, live))
    assert (ready.condition.status, ready.ready_replicas) == ("True", 3)
    assert readiness_view(spec, {})[0] is None
    ds_spec = parse_spec(cr({"workload": "DisaggregatedSet", "prefill": {}, "decode": {}}))
    rows = [{"name": "prefill", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
            {"name": "decode", "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}]
    view, desired = readiness_view(ds_spec, {"DisaggregatedSet/chat-pd": {
        "status": {"roleStatuses": rows}}})
    assert readiness(view, desired).condition.status == "True"


def test_render_prints_both_pools() -> None:
    text = render(json.dumps(cr({"prefill": {}, "decode": {}})))
    assert "name: chat-prefill" in text and "name: chat-decode" in text
    assert "name: chat-engine\n" in text  # the Service, not a Deployment
    assert "# prefill/decode pools (Deployments): 1 prefill + 1 decode replica(s)" in text


def test_the_example_renders_both_pools_with_their_hpas() -> None:
    example = Path(__file__).resolve().parents[3] / "manifests" / "examples" / \
        "llama-3-8b-disaggregated.yaml"
    docs = [d for d in yaml.safe_load_all(render(example.read_text())) if d]
    keys = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
    assert {"Deployment/llama-3-8b-pd-prefill", "Deployment/llama-3-8b-pd-decode",
            "HorizontalPodAutoscaler/llama-3-8b-pd-prefill",
            "HorizontalPodAutoscaler/llama-3-8b-pd-decode"} <= keys
    assert "Deployment/llama-3-8b-pd-engine" not in keys
