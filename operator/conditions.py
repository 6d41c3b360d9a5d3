"""status.conditions and readiness: pure functions from what the API server shows to status."""

from __future__ import annotations

import datetime
from dataclasses import dataclass


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_conditions(existing: list[dict], new: list[Condition], generation: int | None,
                     timestamp: str) -> list[dict]:
    """Existing conditions updated with new ones; lastTransitionTime moves only on a flip."""
    by_type = {c.get("type"): dict(c) for c in existing}
    for cond in new:
        old = by_type.get(cond.type, {})
        flipped = old.get("status") != cond.status
        entry = {"type": cond.type, "status": cond.status, "reason": cond.reason,
                 "message": cond.message,
                 "lastTransitionTime": timestamp if flipped else old.get("lastTransitionTime",
                                                                         timestamp)}
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[cond.type] = entry
    return sorted(by_type.values(), key=lambda c: c.get("type", ""))


def same_conditions(a: list[dict], b: list[dict]) -> bool:
    """Equal apart from timestamps (so an unchanged status is not rewritten)."""
    def strip(conds: list[dict]) -> list[dict]:
        return [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conds]
    return strip(a) == strip(b)


@dataclass(frozen=True)
class Readiness:
    replicas: int
    ready_replicas: int
    condition: Condition


def readiness(deployment: dict | None, desired: int) -> Readiness:
    """Ready when the engine Deployment has all desired replicas ready and updated."""
    if deployment is None:
        return Readiness(0, 0, Condition("Ready", "False", "Progressing",
                                         "the engine Deployment does not exist yet"))
    st = deployment.get("status", {})
    ready, total = st.get("readyReplicas", 0), st.get("replicas", 0)
    updated = st.get("updatedReplicas", 0)
    if desired == 0:
        cond = Condition("Ready", "False", "ScaledToZero", "spec.replicas is 0")
    elif ready >= desired and updated >= desired:
        cond = Condition("Ready", "True", "ReplicasReady", f"{ready}/{desired} engine replicas "
                         "ready")
    else:
        cond = Condition("Ready", "False", "Progressing",
                         f"{ready}/{desired} engine replicas ready ({updated} updated); pods load "
                         "the model before /health turns ready")
    return Readiness(total, ready, cond)
