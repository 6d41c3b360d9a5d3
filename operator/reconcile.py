"""Apply desired objects idempotently (create, or merge-patch what differs); prune leftovers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.operator.kube import PLURALS, KubeClient, KubeError, KubeTransientError
from kvserve.operator.spec import quantity_value


def is_subset(desired: Any, actual: Any) -> bool:
    """True when every field of desired is present and equal in actual (server defaults ignored)."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            key in actual and is_subset(value, actual[key]) for key, value in desired.items())
    if isinstance(desired, list):
        return (isinstance(actual, list) and len(desired) == len(actual)
                and all(is_subset(d, a) for d, a in zip(desired, actual)))
    if isinstance(desired, bool) or isinstance(actual, bool):
        return desired is actual
    if desired == actual:
        return True
    # The API server rewrites quantities canonically ("1024Mi" -> "1Gi", 2 -> "2").
    if isinstance(desired, (str, int, float)) and isinstance(actual, (str, int, float)):
        a, b = quantity_value(desired), quantity_value(actual)
        return a is not None and a == b
    return False


def merge_patch(desired: dict, actual: dict) -> dict:
    """The fields of desired that differ from actual (lists replace whole, as merge patch does)."""
    patch: dict = {}
    for key, value in desired.items():
        current = actual.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            sub = merge_patch(value, current)
            if sub:
                patch[key] = sub
        elif not is_subset(value, current):
            patch[key] = value
    return patch


@dataclass
class ApplyResult:
    created: list[str] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    live: dict[str, dict] = field(default_factory=dict)  # "Kind/name" -> the server's object

    @property
    def changed(self) -> bool:
        return bool(self.created or self.patched or self.deleted)


def key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def _create(kube: KubeClient, obj: dict) -> dict | None:
    """Create obj; None when someone else (a concurrent resync) created it first."""
    try:
        return kube.create(obj)
    except KubeError as exc:
        if exc.status != 409:
            raise
        return None


def apply_objects(kube: KubeClient, objects: list[dict]) -> ApplyResult:
    """Create what is missing and patch what differs; untouched objects cost one GET."""
    result = ApplyResult()
    for obj in objects:
        meta = obj["metadata"]
        actual = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if actual is None:
            created = _create(kube, obj)
            if created is not None:
                result.live[key(obj)] = created
                result.created.append(key(obj))
                continue
            actual = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
            if actual is None:
                raise KubeTransientError(f"{key(obj)} both exists (409) and does not (404)", 409)
        patch = merge_patch(obj, actual)
        if patch:
            result.live[key(obj)] = kube.patch(obj, patch)
            result.patched.append(key(obj))
        else:
            result.live[key(obj)] = actual
            result.unchanged.append(key(obj))
    return result


def owned_by(obj: dict, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))


def prune(kube: KubeClient, namespace: str, instance: str, uid: str, desired: list[dict],
          result: ApplyResult) -> None:
    """Delete objects this service owns that are no longer desired (router off, HPA removed)."""
    wanted = {key(obj) for obj in desired}
    selector = (f"app.kubernetes.io/instance={instance},"
                "app.kubernetes.io/managed-by=kvserve-operator")
    for api_version, kind in PLURALS:
        for obj in kube.list(api_version, kind, namespace, selector):
            name = obj.get("metadata", {}).get("name", "")
            labels = obj.get("metadata", {}).get("labels", {})
            if (f"{kind}/{name}" not in wanted and owned_by(obj, uid)
                    and labels.get("app.kubernetes.io/instance") == instance):
                kube.delete(api_version, kind, namespace, name)
                result.deleted.append(f"{kind}/{name}")
