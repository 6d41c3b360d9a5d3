"""The CRD is structural, its defaults satisfy their own schema, and its paths exist."""

from __future__ import annotations

from kvserve.operator.crd import crd_manifest, spec_schema
from kvserve.operator.spec import schema_errors

EXEMPT = ("x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string")


def walk(schema: dict, path: str = "") -> list[tuple[str, dict]]:
    out = [(path, schema)]
    for key, sub in schema.get("properties", {}).items():
        out += walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += walk(schema["additionalProperties"], f"{path}{{}}")
    return out


def test_every_node_is_typed_and_spec_nodes_are_described() -> None:
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in walk(schema):
        assert "type" in node or any(node.get(k) for k in EXEMPT), path
    for path, node in walk(spec_schema(), "spec"):
        if not path.endswith("{}"):
            assert node.get("description"), f"{path} has no description"


def test_defaults_satisfy_their_own_schema() -> None:
    for path, node in walk(spec_schema(), "spec"):
        if "default" in node:
            assert schema_errors(node, node["default"], path) == []


def test_subresources_and_columns_point_at_real_fields() -> None:
    version = crd_manifest()["spec"]["versions"][0]
    props = version["schema"]["openAPIV3Schema"]["properties"]
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicas" and "replicas" in props["spec"][
        "properties"]
    assert "selector" in props["status"]["properties"]
    assert "replicas" in props["status"]["properties"]
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names == ["Ready", "Replicas", "GPUs/Replica", "Max-Concurrency", "Age"]
    sizing = props["status"]["properties"]["sizing"]["properties"]
    assert {"gpusPerReplica", "maxConcurrency"} <= set(sizing)


def test_names() -> None:
    spec = crd_manifest()["spec"]
    assert crd_manifest()["metadata"]["name"] == "kvinferenceservices.kvserve.io"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["shortNames"]) == (
        "kvserve.io", "KVInferenceService", ["kvis"])
