"""Multi-node replicas: a model that needs two nodes becomes a LeaderWorkerSet (valid against
LWS's own CRD schema, pod templates against Kubernetes' PodTemplate schema), its leaders behind
the Service; a model that fits a node stays a Deployment."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from crd_schemas import FILES
from crd_schemas import errors as crd_errors
from kvserve.engine.worker.rank_env import from_environ
from kvserve.operator.children import build_children
from kvserve.operator.leader_worker_set import WORKER_INDEX_LABEL
from kvserve.operator.render import render
from kvserve.operator.resources import selector_string

NS = "ml"


def cr(model: str = "llama-3.1-405b", **spec: Any) -> dict:
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "big", "namespace": NS, "uid": "uid-big"},
            "spec": {"model": {"name": model}, "gpu": {"type": "H100-80GB"},
                     "engine": {"maxModelLen": 8192}, **spec}}


def by_key(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def pod_template_errors(template: dict) -> None:
    """Kubernetes' own schema for a pod template (what LWS embeds as corev1.PodTemplateSpec)."""
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                  "metadata": {"name": "t", "namespace": NS},
                                  "template": template}, "1.31", strict=True)


def test_405b_on_h100_is_a_leader_worker_set_of_two_8_gpu_pods() -> None:
    objs = by_key(cr())
    assert "Deployment/big-engine" not in objs
    lws = objs["LeaderWorkerSet/big-engine"]
    assert crd_errors(lws) == []
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert (tmpl["size"], tmpl["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert lws["spec"]["networkConfig"] == {"subdomainPolicy": "Shared"}
    for role in ("leaderTemplate", "workerTemplate"):
        pod_template_errors(tmpl[role])
        container = tmpl[role]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == "8"
        assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    leader = tmpl["leaderTemplate"]["spec"]["containers"][0]
    worker = tmpl["workerTemplate"]["spec"]["containers"][0]
    assert "--headless" not in leader["args"] and leader["readinessProbe"]
    assert worker["args"][:2] == ["serve", "--headless"]
    assert "readinessProbe" not in worker and "http" not in {p["name"] for p in worker["ports"]}


def test_every_object_of_a_multi_node_service_validates() -> None:
    objs = build_children(cr(autoscaling={"minReplicas": 1, "maxReplicas": 3})).objects
    assert {"LeaderWorkerSet", "HorizontalPodAutoscaler", "NetworkPolicy"} <= \
        {o["kind"] for o in objs}
    for obj in objs:
        if obj["kind"] in FILES:
            assert crd_errors(obj) == [], obj["kind"]
        else:
            kubernetes_validate.validate(obj, "1.31", strict=True)


def test_the_schema_check_can_fail() -> None:
    lws = by_key(cr())["LeaderWorkerSet/big-engine"]
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    del bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert len(crd_errors(bad)) == 3
    with pytest.raises(kubernetes_validate.ValidationError):
        worker = copy.deepcopy(lws["spec"]["leaderWorkerTemplate"]["workerTemplate"])
        worker["spec"]["containers"][0]["gpus"] = 8
        pod_template_errors(worker)


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_service_router_hpa_and_status_select_leaders_only() -> None:
    body = cr(autoscaling={"minReplicas": 1, "maxReplicas": 3})
    objs = by_key(body)
    tmpl = objs["LeaderWorkerSet/big-engine"]["spec"]["leaderWorkerTemplate"]
    leader = tmpl["leaderTemplate"]["metadata"]["labels"]
    worker = tmpl["workerTemplate"]["metadata"]["labels"]
    for name in ("Service/big-engine", "PodDisruptionBudget/big-engine"):
        spec = objs[name]["spec"]
        sel = spec.get("selector", {}).get("matchLabels", spec.get("selector"))
        assert labels_match(sel, leader) and not labels_match(sel, worker), name
    status_sel = dict(kv.split("=") for kv in selector_string(build_children(body).spec)
                      .split(","))
    assert labels_match(status_sel, leader) and not labels_match(status_sel, worker)
    assert objs["HorizontalPodAutoscaler/big"]["spec"]["scaleTargetRef"]["kind"] == \
        "KVInferenceService"  # it scales spec.replicas: whole groups
    router = objs["Deployment/big-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "http://big-engine:8000" in router  # the leaders' Service


def test_ranks_find_each_other_from_the_rendered_env() -> None:
    """LWS puts LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX first; the rendered env
    adds the worker index from the downward API and MASTER_PORT. The engine's own reader
    (engine/worker/rank_env.py) then puts pod 1 at ranks 8-15 of the 16."""
    tmpl = by_key(cr())["LeaderWorkerSet/big-engine"]["spec"]["leaderWorkerTemplate"]
    container = tmpl["workerTemplate"]["spec"]["containers"][0]
    index = next(e for e in container["env"] if e["name"] == "LWS_WORKER_INDEX")
    assert index["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.labels['{WORKER_INDEX_LABEL}']"
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env.update(LWS_LEADER_ADDRESS="big-engine-0.big-engine.ml", LWS_WORKER_INDEX="1")
    ranks = from_environ(env)
    assert (ranks.nodes, ranks.node, ranks.master_port) == (2, 1, 29500)
    assert ranks.master_addr == "big-engine-0.big-engine.ml"
    assert list(ranks.ranks(16)) == list(range(8, 16))
    ports = {p["containerPort"] for p in container["ports"]}
    assert {ranks.master_port, ranks.command_port} == ports
    for role in ("leaderTemplate", "workerTemplate"):  # the command channel's key: a Secret
        env = tmpl[role]["spec"]["containers"][0]["env"]
        key = next(e for e in env if e["name"] == "KVSERVE_GROUP_KEY")
        assert key["valueFrom"]["secretKeyRef"]["name"] == "big-registration"


def test_the_serve_parser_reads_leader_and_worker_flags() -> None:
    from kvserve.service.cli import build_parser, engine_config_from_args

    tmpl = by_key(cr())["LeaderWorkerSet/big-engine"]["spec"]["leaderWorkerTemplate"]
    for role, headless in (("leaderTemplate", False), ("workerTemplate", True)):
        args = build_parser().parse_args(tmpl[role]["spec"]["containers"][0]["args"])
        assert bool(getattr(args, "headless", False)) is headless
        config = engine_config_from_args(args)
        assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (8, 2)


def test_ranks_of_a_group_reach_each_other_past_the_network_policies() -> None:
    objs = by_key(cr())
    group = objs["NetworkPolicy/big-engine-group"]["spec"]
    pods = group["podSelector"]["matchLabels"]
    assert pods["leaderworkerset.sigs.k8s.io/name"] == "big-engine"
    assert group["ingress"] == [{"from": [{"podSelector": {"matchLabels": pods}}]}]
    no_policies = by_key(cr(networkPolicy={"enabled": False}))
    assert "NetworkPolicy/big-engine-group" not in no_policies


def test_an_8b_model_stays_a_deployment() -> None:
    objs = by_key(cr("llama-3-8b"))
    assert not [k for k in objs if k.startswith("LeaderWorkerSet/")]
    assert "NetworkPolicy/big-engine-group" not in objs
    dep = objs["Deployment/big-engine"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "1"
    assert "--pipeline-parallel-size" not in args and "--headless" not in args


def test_a_target_sets_the_group_count_within_autoscaling_bounds() -> None:
    """600 requests of 8192 tokens: 3 groups of TP 8 x PP 3 (233 each, 72 GPUs) beat 7 of PP 2
    (92 each, 112 GPUs) and 3 of PP 4 (capped at maxNumSeqs 256, 96 GPUs); maxReplicas caps."""
    built = build_children(cr(sizing={"targetConcurrency": 600}))
    s = built.sizing
    assert (s.pipeline_parallel_size, s.max_concurrency, s.replicas_for_target) == (3, 233, 3)
    lws = {o["kind"]: o for o in built.objects}["LeaderWorkerSet"]
    assert lws["spec"]["replicas"] == 3 and lws["spec"]["leaderWorkerTemplate"]["size"] == 3
    capped = by_key(cr(sizing={"targetConcurrency": 600},
                       autoscaling={"minReplicas": 1, "maxReplicas": 2}))
    assert capped["LeaderWorkerSet/big-engine"]["spec"]["replicas"] == 2
    assert by_key(cr())["LeaderWorkerSet/big-engine"]["spec"]["replicas"] == 1  # spec.replicas


def test_render_says_the_layout() -> None:
    text = render("apiVersion: kvserve.io/v1alpha1\nkind: KVInferenceService\n"
                  "metadata: {name: big}\nspec: {model: {name: llama-3.1-405b}, "
                  "gpu: {type: H100-80GB}, engine: {maxModelLen: 8192}}\n")
    assert "# TP 8 x PP 2 on 2 nodes of 8 GPUs: a LeaderWorkerSet group per replica" in text
    assert "# warning: pipeline across 2 nodes" in text
    assert "kind: LeaderWorkerSet" in text


def test_keda_reads_the_leaders_metrics() -> None:
    """Leader pods are <lws>-<group>; workers <lws>-<group>-<index> serve no metrics."""
    import re

    objs = by_key(cr(autoscaling={"minReplicas": 1, "maxReplicas": 3, "engine": "keda",
                                  "prometheusAddress": "http://prometheus:9090"}))
    queries = [t["metadata"]["query"] for t in objs["ScaledObject/big"]["spec"]["triggers"]]
    pattern = re.search(r'pod=~"([^"]+)"', queries[0]).group(1)
    assert re.fullmatch(pattern, "big-engine-0") and re.fullmatch(pattern, "big-engine-12")
    assert not re.fullmatch(pattern, "big-engine-0-1")
    small = by_key(cr("llama-3-8b", autoscaling={"minReplicas": 1, "maxReplicas": 3,
                                                 "engine": "keda",
                                                 "prometheusAddress": "http://prometheus:9090"}))
    query = small["ScaledObject/big"]["spec"]["triggers"][0]["metadata"]["query"]
    assert re.fullmatch(re.search(r'pod=~"([^"]+)"', query).group(1), "big-engine-7c9f-x2x4z")
