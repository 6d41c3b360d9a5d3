"""Objects from resources.py: valid Kubernetes, owned, and started with the servers' real flags."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from crd_schemas import FILES
from crd_schemas import errors as crd_errors
from kvserve.operator.children import build_children
from kvserve.operator.resources import engine_args
from kvserve.operator.sizing import plan
from kvserve.operator.spec import parse_spec

EXAMPLES = Path(__file__).resolve().parents[3] / "manifests" / "examples"


def load(name: str) -> dict:
    body = yaml.safe_load((EXAMPLES / name).read_text())
    body["metadata"].update(namespace="ml", uid="uid-1")
    return body


def variants() -> list[tuple[str, dict]]:
    base = {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "v", "namespace": "ml", "uid": "uid-2"},
            "spec": {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"}}}
    no_router = {**base, "spec": {**base["spec"], "router": {"enabled": False},
                                  "redis": {"deploy": False}}}
    shared_redis = {**base, "spec": {**base["spec"], "redis": {"url": "redis://r:6379/1"},
                                     "autoscaling": {"maxReplicas": 3,
                                                     "targetWaitingRequests": 0}}}
    cases = [(p.name, load(p.name)) for p in sorted(EXAMPLES.glob("*.yaml"))]
    return cases + [("no-router", no_router), ("shared-redis", shared_redis)]


def objects(body: dict) -> list[dict]:
    return build_children(body).objects


@pytest.mark.parametrize("name, body", variants(), ids=[n for n, _ in variants()])
def test_every_object_validates_and_is_owned(name: str, body: dict) -> None:
    for obj in objects(body):
        if obj["kind"] in FILES:  # add-on kinds: their CRDs' schemas (vendored excerpts)
            assert crd_errors(obj) == [], obj["kind"]
        else:
            kubernetes_validate.validate(obj, "1.31", strict=True)
        owner = obj["metadata"]["ownerReferences"][0]
        # An InferencePool is shared by the gateways' controllers (each writes its own
        # status.parents entry), so the operator owns it without claiming to be its controller
        # (inference_pool.share_pool_ownership); every other object has the service as its one.
        controller = obj["kind"] != "InferencePool"
        assert (owner["kind"], owner["uid"], owner["controller"]) == (
            "KVInferenceService", body["metadata"]["uid"], controller)
        assert obj["metadata"]["namespace"] == "ml"


def test_validation_is_strict() -> None:
    deployment = next(o for o in objects(load("llama-2-7b-a100.yaml")) if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.31", strict=True)


def by_name(objs: list[dict]) -> dict[str, dict]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def test_gpu_engine_pod() -> None:
    objs = by_name(objects(load("llama-3-70b-h100-fp8.yaml")))
    pod = objs["Deployment/llama-3-70b-engine"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert container["resources"]["limits"]["memory"] == "400Gi"  # the user's own, kept
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--served-model-name") + 1] == "llama-3-70b-instruct"
    assert {"type": "RuntimeDefault"} == pod["securityContext"]["seccompProfile"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert any(v["name"] == "shm" for v in pod["volumes"])  # tensor parallel ranks share memory
    assert {"name": "HF_TOKEN"}.items() <= container["env"][-1].items()
    annotations = objs["Deployment/llama-3-70b-engine"]["spec"]["template"]["metadata"][
        "annotations"]
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == "8000"


def test_cpu_example_has_no_gpu_and_no_hpa() -> None:
    objs = by_name(objects(load("smollm2-cpu-kind.yaml")))
    container = objs["Deployment/smollm2-engine"]["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert "HorizontalPodAutoscaler/smollm2" not in objs
    assert objs["Deployment/smollm2-engine"]["spec"]["replicas"] == 2


def test_hpa_targets_the_scale_subresource_on_both_metrics() -> None:
    hpa = by_name(objects(load("llama-2-7b-a100.yaml")))["HorizontalPodAutoscaler/llama-2-7b"]
    spec = hpa["spec"]
    assert spec["scaleTargetRef"]["kind"] == "KVInferenceService"
    metrics = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
               for m in spec["metrics"]}
    assert metrics == {"vllm_kv_cache_usage_perc": "800m", "vllm_num_requests_waiting": "4"}


def test_router_off_points_the_entry_service_at_the_engines() -> None:
    name, body = variants()[-2]
    objs = by_name(objects(body))
    assert "Deployment/v-router" not in objs and "Deployment/v-redis" not in objs
    assert objs["Service/v"]["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    args = objs["Deployment/v-engine"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--redis-url" not in args


def test_engine_args_parse_with_the_real_serve_cli() -> None:
    from kvserve.service.cli import build_parser, engine_config_from_args

    spec = parse_spec(load("llama-2-7b-a100.yaml"))
    args = build_parser().parse_args(engine_args(spec, plan(spec)))
    config = engine_config_from_args(args)  # the engine's own checks accept every value
    assert (config.model, config.max_model_len, config.block_size) == (
        "meta-llama/Llama-2-7b-hf", 4096, 16)
    assert (config.gpu_memory_utilization, config.enable_prefix_caching) == (0.9, True)
    assert args.redis_url == "redis://llama-2-7b-redis:6379/0"
    assert args.service_name == "llama-2-7b" and args.advertise_url == "http://$(POD_IP):8000"
    assert args.host == "0.0.0.0" and args.port == 8000
    pod = by_name(objects(load("llama-2-7b-a100.yaml")))["Deployment/llama-2-7b-engine"]
    grace = pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert 5 + args.shutdown_grace_period < grace  # preStop sleep + drain fit before SIGKILL


def test_cpu_engine_gets_the_planned_kv_budget_through_the_real_cli() -> None:
    from kvserve.service.cli import build_parser, engine_config_from_args

    spec = parse_spec(load("smollm2-cpu-kind.yaml"))
    sizing = plan(spec)
    config = engine_config_from_args(build_parser().parse_args(engine_args(spec, sizing)))
    assert config.kv_cache_memory == sizing.kv_bytes > 0
    assert config.dtype == "float32" and config.model == "smollm2-135m-instruct"


def test_router_args_parse_with_the_real_router_cli() -> None:
    from kvserve.service.cli import build_parser

    objs = by_name(objects(load("llama-2-7b-a100.yaml")))
    container = objs["Deployment/llama-2-7b-router"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert (args.command, args.policy, args.port) == ("router", "prefix", 8000)
    assert args.redis_url == "redis://llama-2-7b-redis:6379/0"
    assert args.service_name == "llama-2-7b"
    assert args.replicas == "http://llama-2-7b-engine:8000"
    pod = objs["Deployment/llama-2-7b-router"]["spec"]["template"]["spec"]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert 5 + args.shutdown_grace_period < pod["terminationGracePeriodSeconds"]  # drain fits


def test_config_change_rolls_the_pods() -> None:
    body = load("llama-2-7b-a100.yaml")
    before = by_name(objects(body))["Deployment/llama-2-7b-engine"]
    body["spec"]["engine"]["maxModelLen"] = 2048
    after = by_name(objects(body))["Deployment/llama-2-7b-engine"]
    key = "kvserve.io/config-hash"
    assert (before["spec"]["template"]["metadata"]["annotations"][key]
            != after["spec"]["template"]["metadata"]["annotations"][key])
