"""The chart for multi-node replicas: real `helm template` gives the operator the RBAC for
LeaderWorkerSets and a CRD with spec.sizing and spec.gpu.perNode; the multi-node example
validates against that CRD and renders to a LeaderWorkerSet valid against LWS's schema."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvserve.operator.render import render as render_service

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvserve"
EXAMPLE = ROOT / "manifests" / "examples" / "llama-3.1-405b-multi-node.yaml"


@pytest.fixture(scope="module")
def chart() -> list[dict]:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_helm.py")],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    helm = Path(done.stdout.strip()) / "helm"
    out = subprocess.run([str(helm), "template", "kvserve", str(CHART), "--namespace", "kvserve",
                          "--include-crds"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def lws_errors(obj: dict) -> list[str]:
    path = ROOT / "tests" / "unit" / "operator" / "crd_schemas.py"
    spec = importlib.util.spec_from_file_location("crd_schemas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.errors(obj)


def test_the_operator_may_manage_leader_worker_sets(chart: list[dict]) -> None:
    role = next(o for o in chart if o["kind"] == "ClusterRole")
    rules = [r for r in role["rules"] if "leaderworkerset.x-k8s.io" in r["apiGroups"]]
    assert rules and rules[0]["resources"] == ["leaderworkersets"]
    assert {"get", "list", "watch", "create", "patch", "delete"} <= set(rules[0]["verbs"])


def test_the_example_validates_and_renders_a_leader_worker_set(chart: list[dict]) -> None:
    crd = next(o for o in chart if o["kind"] == "CustomResourceDefinition")
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    spec = schema["properties"]["spec"]["properties"]
    assert "targetConcurrency" in spec["sizing"]["properties"]
    assert "perNode" in spec["gpu"]["properties"]
    body = yaml.safe_load(EXAMPLE.read_text())
    assert list(jsonschema.Draft7Validator(schema).iter_errors(body)) == []
    bad = {**body, "spec": {**body["spec"], "sizing": {"targetConcurrency": 0}}}
    assert list(jsonschema.Draft7Validator(schema).iter_errors(bad))
    docs = [d for d in yaml.safe_load_all(render_service(EXAMPLE.read_text())) if d]
    lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    assert len(lws) == 1 and lws_errors(lws[0]) == []
    assert lws[0]["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert not [d for d in docs if d["kind"] == "Deployment"
                and d["metadata"]["name"] == "llama-405b-engine"]
