"""Day-two objects: weights cache, Ingress/HTTPRoute, monitors, KEDA, and `kvserve render`."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from crd_schemas import FILES, errors
from kvserve.operator.__main__ import main as operator_main
from kvserve.operator.children import build_children
from kvserve.operator.spec import InvalidSpecError
from kvserve.operator.weights import WEIGHTS_DIR

CORE = {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler",
        "PersistentVolumeClaim", "Ingress", "NetworkPolicy", "Secret"}


def cr(**spec: object) -> dict:
    base = {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}}
    base.update(spec)
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-9"}, "spec": base}


def everything_on() -> dict:
    return cr(model={"name": "llama-3-8b", "uri": "hf://meta-llama/Meta-Llama-3-8B:v2",
                     "cache": {"pvc": {"size": "60Gi", "storageClassName": "nfs"}}},
              nodeSelector={"gpu": "l40s"},
              autoscaling={"maxReplicas": 4, "engine": "keda"},
              ingress={"host": "chat.example.com", "className": "nginx",
                       "tlsSecretName": "chat-tls",
                       "annotations": {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"}},
              gateway={"parentRefs": [{"name": "public", "namespace": "gateways",
                                       "sectionName": "https"}],
                       "hostnames": ["chat.example.com"]},
              monitoring={"serviceMonitor": True, "podMonitor": True,
                          "labels": {"release": "prometheus"}})


def by_key(body: dict) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in build_children(body).objects}


def engine_pod(objs: dict[str, dict]) -> dict:
    return objs["Deployment/chat-engine"]["spec"]["template"]["spec"]


def test_every_object_with_every_option_validates() -> None:
    objs = by_key(everything_on())
    kinds = {o["kind"] for o in objs.values()}
    assert {"PersistentVolumeClaim", "Ingress", "HTTPRoute", "ServiceMonitor", "PodMonitor",
            "ScaledObject"} <= kinds
    assert "HorizontalPodAutoscaler" not in kinds  # KEDA makes its own HPA
    for obj in objs.values():
        if obj["kind"] in CORE:
            kubernetes_validate.validate(obj, "1.31", strict=True)
        else:
            assert errors(obj) == [], obj["kind"]
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-9"


@pytest.mark.parametrize("kind, breakage", [
    ("HTTPRoute", lambda o: o["spec"]["rules"][0]["backendRefs"][0].update(port="8000")),
    ("HTTPRoute", lambda o: o["spec"]["parentRefs"][0].update(namespace="Bad_NS")),
    ("ServiceMonitor", lambda o: o["spec"]["endpoints"][0].update(interval="15 seconds")),
    ("PodMonitor", lambda o: o["spec"].update(podMetricEndpoints=[])),  # a typo of the field
    ("ScaledObject", lambda o: o["spec"]["triggers"][0].pop("metadata")),
])
def test_the_vendored_schemas_catch_mistakes(kind: str, breakage: object) -> None:
    obj = copy.deepcopy(next(o for o in by_key(everything_on()).values() if o["kind"] == kind))
    breakage(obj)
    assert errors(obj)


def test_every_vendored_schema_is_used() -> None:
    kinds = {o["kind"] for o in by_key(everything_on()).values()}
    # InferencePool: spec.routing.mode inferencePool (tests/unit/operator/test_inference_pool.py)
    kinds |= {o["kind"] for o in by_key(cr(routing={"mode": "inferencePool"})).values()}
    # LeaderWorkerSet: a replica over two nodes (tests/unit/operator/test_leader_worker_set.py)
    kinds |= {o["kind"] for o in by_key(cr(model={"name": "llama-3.1-405b"},
                                              gpu={"type": "H100-80GB"},
                                              engine={"maxModelLen": 8192})).values()}
    # DisaggregatedSet: spec.disaggregation.workload (tests/unit/operator/test_pd_roles.py)
    kinds |= {o["kind"] for o in by_key(cr(disaggregation={
        "workload": "DisaggregatedSet"})).values()}
    assert set(FILES) <= kinds


def test_weights_cache_claim_and_init_container() -> None:
    objs = by_key(everything_on())
    claim = objs["PersistentVolumeClaim/chat-weights"]["spec"]
    assert claim == {"accessModes": ["ReadWriteMany"], "storageClassName": "nfs",
                     "resources": {"requests": {"storage": "60Gi"}}}
    pod = engine_pod(objs)
    init = pod["initContainers"][0]
    assert init["command"][:3] == ["python", "-m", "kvserve.operator.fetch"]
    assert init["command"][3:] == ["--uri", "hf://meta-llama/Meta-Llama-3-8B", "--revision", "v2",
                                   "--cache", WEIGHTS_DIR]
    assert {"name": "weights", "mountPath": WEIGHTS_DIR} in init["volumeMounts"]
    engine = pod["containers"][0]
    assert {"name": "weights", "mountPath": WEIGHTS_DIR, "readOnly": True} in engine[
        "volumeMounts"]
    assert engine["args"][1] == f"{WEIGHTS_DIR}/models/meta-llama--Meta-Llama-3-8B"
    assert "--revision" not in engine["args"]  # the claim holds that revision already
    volume = next(v for v in pod["volumes"] if v["name"] == "weights")
    assert volume["persistentVolumeClaim"] == {"claimName": "chat-weights"}


def test_existing_claim_and_pvc_uri() -> None:
    objs = by_key(cr(model={"name": "llama-3-8b", "cache": {"claimName": "shared-models"}}))
    assert not [k for k in objs if k.startswith("PersistentVolumeClaim/")]
    assert engine_pod(objs)["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "shared-models"
    objs = by_key(cr(model={"name": "llama-3-8b", "uri": "pvc://models/llama3/8b"}))
    pod = engine_pod(objs)
    assert "initContainers" not in pod  # nothing to fetch: the claim holds the weights
    assert pod["containers"][0]["args"][1] == f"{WEIGHTS_DIR}/llama3/8b"
    volume = next(v for v in pod["volumes"] if v["name"] == "weights")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    router = objs["Deployment/chat-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"][router["args"].index("--tokenizer") + 1] == f"{WEIGHTS_DIR}/llama3/8b"


def test_hub_uri_without_cache_passes_the_revision() -> None:
    objs = by_key(cr(model={"name": "llama-3-8b", "uri": "hf://meta-llama/Meta-Llama-3-8B:abc"}))
    args = engine_pod(objs)["containers"][0]["args"]
    assert args[1] == "meta-llama/Meta-Llama-3-8B"
    assert args[args.index("--revision") + 1] == "abc"
    assert "initContainers" not in engine_pod(objs)


@pytest.mark.parametrize("model, message", [
    ({"name": "llama-3-8b", "uri": "s3://bucket/llama"}, "s3:// is planned, not supported yet"),
    ({"name": "llama-3-8b", "uri": "gs://bucket/llama"}, "unknown scheme 'gs'"),
    ({"name": "llama-3-8b", "uri": "hf://not-a-repo"}, "write hf://ORG/NAME"),
    ({"name": "llama-3-8b", "uri": "pvc://models/x", "cache": {"claimName": "c"}},
     "already names the claim"),
    ({"name": "llama-3-8b", "cache": {"claimName": "c", "pvc": {}}}, "exactly one of"),
])
def test_bad_model_sources_are_refused(model: dict, message: str) -> None:
    with pytest.raises(InvalidSpecError, match=message.replace("(", r"\(")):
        build_children(cr(model=model))


def test_removed_node_selector_leaves_no_node_selector_key() -> None:
    """Server-side apply removes what the operator no longer sends: the key must be absent,
    not an empty map (an empty map would be a field the operator still owns)."""
    assert engine_pod(by_key(cr(nodeSelector={"gpu": "l40s"})))["nodeSelector"] == {"gpu": "l40s"}
    assert "nodeSelector" not in engine_pod(by_key(cr()))


def test_ingress_and_route_point_at_the_entry_service() -> None:
    objs = by_key(everything_on())
    ingress = objs["Ingress/chat"]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"hosts": ["chat.example.com"], "secretName": "chat-tls"}]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "chat", "port": {"name": "http"}}
    assert ingress["metadata"]["annotations"][
        "nginx.ingress.kubernetes.io/proxy-read-timeout"] == "600"
    route = objs["HTTPRoute/chat"]["spec"]
    assert route["rules"][0]["backendRefs"] == [{"name": "chat", "port": 8000}]
    assert objs["Service/chat"]["spec"]["selector"]["app.kubernetes.io/component"] == "router"


def test_monitors_select_engine_and_router_once() -> None:
    objs = by_key(everything_on())
    sm = objs["ServiceMonitor/chat"]
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["selector"]["matchExpressions"][0]["values"] == ["engine", "entry"]
    assert objs["PodMonitor/chat"]["spec"]["selector"]["matchExpressions"][0]["values"] == [
        "engine", "router"]
    no_router = by_key(cr(router={"enabled": False}, monitoring={"serviceMonitor": True}))
    # The entry Service selects the engine pods then: selecting it too would scrape them twice.
    assert no_router["ServiceMonitor/chat"]["spec"]["selector"]["matchExpressions"][0][
        "values"] == ["engine"]


def test_keda_scales_the_scale_subresource_on_both_metrics() -> None:
    so = by_key(everything_on())["ScaledObject/chat"]["spec"]
    assert so["scaleTargetRef"] == {"apiVersion": "kvserve.io/v1alpha1",
                                    "kind": "KVInferenceService", "name": "chat"}
    queries = [t["metadata"]["query"] for t in so["triggers"]]
    assert queries == [
        'sum(vllm:kv_cache_usage_perc{namespace="ml",pod=~"chat-engine-[a-z0-9]+-[a-z0-9]+"})',
        'sum(vllm:num_requests_waiting{namespace="ml",pod=~"chat-engine-[a-z0-9]+-[a-z0-9]+"})']
    assert [t["metadata"]["threshold"] for t in so["triggers"]] == ["0.8", "4"]
    hpa = by_key(cr(autoscaling={"maxReplicas": 4}))
    assert "HorizontalPodAutoscaler/chat" in hpa and "ScaledObject/chat" not in hpa


def test_render_prints_exactly_the_handlers_objects(tmp_path: Path, capsys) -> None:
    body = everything_on()
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(body))
    assert operator_main(["render", "-f", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# chat: 1 GPU(s)/replica")
    rendered = [d for d in yaml.safe_load_all(out) if d]
    assert rendered == build_children(body).objects


def test_render_without_uid_has_no_owner_references(tmp_path: Path, capsys) -> None:
    body = everything_on()
    del body["metadata"]["uid"], body["metadata"]["namespace"]
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(body))
    assert operator_main(["render", "-f", str(path), "-n", "prod"]) == 0
    rendered = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert all("ownerReferences" not in o["metadata"] for o in rendered)
    assert {o["metadata"]["namespace"] for o in rendered} == {"prod"}


def test_render_refuses_a_bad_spec_with_the_operators_reason(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cr.yaml"
    path.write_text(yaml.safe_dump(cr(model={"name": "llama-3-70b"}, gpu={"type": "L4",
                                                                          "maxPerReplica": 1})))
    assert operator_main(["render", "-f", str(path)]) == 2
    assert "InsufficientGPUMemory" in capsys.readouterr().err


def test_rollouts_never_take_a_ready_replica_away() -> None:
    objs = by_key(everything_on())
    strategy = objs["Deployment/chat-engine"]["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate",
                        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pdb = objs["PodDisruptionBudget/chat-engine"]["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"] == objs["Deployment/chat-engine"]["spec"]["selector"]
