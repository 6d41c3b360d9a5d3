"""Validators for add-on kinds (HTTPRoute, ServiceMonitor, PodMonitor, ScaledObject,
InferencePool, DisaggregatedSet) from the CRD schema excerpts vendored in fixtures/crds, unknown
fields refused."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import yaml

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "crds"
FILES = {"HTTPRoute": "httproute-v1.yaml", "ServiceMonitor": "servicemonitor-v1.yaml",
         "PodMonitor": "podmonitor-v1.yaml", "ScaledObject": "scaledobject-v1alpha1.yaml",
         "InferencePool": "inferencepool-v1.yaml", "LeaderWorkerSet": "leaderworkerset-v1.yaml",
         "DisaggregatedSet": "disaggregatedset-v1.yaml"}


def strict(schema: dict) -> dict:
    schema = copy.deepcopy(schema)
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    for key, sub in schema.get("properties", {}).items():
        schema["properties"][key] = strict(sub)
    if isinstance(schema.get("items"), dict):
        schema["items"] = strict(schema["items"])
    return schema


def validator(kind: str) -> tuple[str, jsonschema.Draft7Validator]:
    doc = yaml.safe_load((FIXTURES / FILES[kind]).read_text())
    return doc["apiVersion"], jsonschema.Draft7Validator(strict(doc["openAPIV3Schema"]))


def errors(obj: dict) -> list[str]:
    """Schema errors of obj against its kind's vendored CRD schema ([] when valid)."""
    api_version, check = validator(obj["kind"])
    found = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in check.iter_errors(obj)]
    if obj["apiVersion"] != api_version:
        found.append(f"apiVersion {obj['apiVersion']} is not {api_version}")
    return found
