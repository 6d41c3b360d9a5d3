"""Apply desired objects by server-side apply (only when they changed); prune leftovers.

Each applied object carries the hash of what was applied: a reconcile that would send the same
object again (the timer, a resume after an operator upgrade) sends nothing, so nothing rolls.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.operator.kube import PLURALS, KubeClient
from kvserve.operator.quantity import quantity_value

APPLIED_HASH = "kvserve.io/applied-hash"
# Kinds never pruned when they leave the desired set: a weights cache is expensive to refill.
# They still go with the service, through their owner reference.
KEEP = {("v1", "PersistentVolumeClaim")}


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


def applied_hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def stamped(obj: dict) -> dict:
    """obj with the hash of its own content in an annotation (not in a pod template: changing
    the hash alone must never roll pods)."""
    obj = copy.deepcopy(obj)
    digest = applied_hash(obj)
    obj["metadata"].setdefault("annotations", {})[APPLIED_HASH] = digest
    return obj


@dataclass
class ApplyResult:
    applied: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    live: dict[str, dict] = field(default_factory=dict)  # "Kind/name" -> the server's object
    foreign: list[str] = field(default_factory=list)  # there, not ours: left alone

    @property
    def changed(self) -> bool:
        return bool(self.applied or self.deleted)


def key(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def up_to_date(desired: dict, actual: dict | None) -> bool:
    """Same hash as last applied, and nobody edited an applied field since."""
    if actual is None:
        return False
    applied = actual.get("metadata", {}).get("annotations", {}).get(APPLIED_HASH)
    return applied == desired["metadata"]["annotations"][APPLIED_HASH] and is_subset(desired,
                                                                                       actual)


def owner_uid(obj: dict) -> str:
    """The uid of the owner kopf.adopt set on a desired object ("" for a CR read from a file);
    an InferencePool's one owner reference is not a controller's (inference_pool.py)."""
    refs = obj.get("metadata", {}).get("ownerReferences", [])
    fallback = refs[0].get("uid", "") if refs else ""
    return next((ref.get("uid", "") for ref in refs if ref.get("controller")), fallback)


def foreign(desired: dict, actual: dict | None) -> bool:
    """An object of the child's name that this service does not own (someone else's, or made by
    hand): applying would take it over, so it is left alone."""
    uid = owner_uid(desired)
    return actual is not None and bool(uid) and not owned_by(actual, uid)


def apply_objects(kube: KubeClient, objects: list[dict]) -> ApplyResult:
    """Server-side apply what is missing or changed; untouched objects cost one GET; objects of
    a child's name owned by someone else are left as they are (result.foreign)."""
    result = ApplyResult()
    for obj in map(stamped, objects):
        meta = obj["metadata"]
        actual = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if foreign(obj, actual):
            result.foreign.append(key(obj))
            continue
        if up_to_date(obj, actual):
            result.live[key(obj)] = actual
            result.unchanged.append(key(obj))
            continue
        result.live[key(obj)] = kube.apply(obj)
        result.applied.append(key(obj))
    return result


def create_missing(kube: KubeClient, objects: list[dict], result: ApplyResult) -> None:
    """Create objects that do not exist; one that does is kept exactly as it is (the
    registration Secret: never rotated, and a user's own Secret of that name is used)."""
    for obj in objects:
        (result.applied if kube.create_once(obj) else result.unchanged).append(key(obj))


def owned_by(obj: dict, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences", []))


def prune(kube: KubeClient, namespace: str, instance: str, uid: str, desired: list[dict],
          result: ApplyResult) -> None:
    """Delete objects this service owns that are no longer desired (router off, HPA removed).
    A kind whose CRD is not installed (Gateway API, prometheus-operator, KEDA) lists as 404,
    which the client reads as empty."""
    wanted = {key(obj) for obj in desired}
    selector = (f"app.kubernetes.io/instance={instance},"
                "app.kubernetes.io/managed-by=kvserve-operator")
    for api_version, kind in PLURALS:
        if (api_version, kind) in KEEP:
            continue
        for obj in kube.list(api_version, kind, namespace, selector):
            name = obj.get("metadata", {}).get("name", "")
            labels = obj.get("metadata", {}).get("labels", {})
            if (f"{kind}/{name}" not in wanted and owned_by(obj, uid)
                    and labels.get("app.kubernetes.io/instance") == instance):
                kube.delete(api_version, kind, namespace, name)
                result.deleted.append(f"{kind}/{name}")
