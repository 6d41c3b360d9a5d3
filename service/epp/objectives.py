"""Inference objectives (GIE's InferenceObjective: a name and a priority) and when the pool is
saturated: requests whose objective has a negative priority are shed (429) then, so the others
are served first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvserve.service.routing_policy import Candidate


class ObjectivesError(ValueError):
    """An objectives file that cannot be read as name -> priority."""


@dataclass(frozen=True)
class Objectives:
    """Priority per objective name (absent: 0, never shed)."""

    priorities: Mapping[str, int] = field(default_factory=dict)

    def priority(self, name: str | None) -> int:
        return self.priorities.get(name, 0) if name else 0

    def sheddable(self, name: str | None) -> bool:
        return self.priority(name) < 0


def parse_objectives(data: Any) -> Objectives:
    """From `{name: priority}`, a list of `{name, priority}`, InferenceObjective objects
    (`metadata.name`, `spec.priority`) or `{objectives: [...]}` (a ConfigMap's document)."""
    if isinstance(data, dict) and "objectives" in data:
        data = data["objectives"]
    if isinstance(data, dict) and "kind" not in data:
        items = list(data.items())
    elif isinstance(data, (list, dict)):
        items = [_pair(d) for d in (data if isinstance(data, list) else [data])]
    else:
        raise ObjectivesError("objectives: write {name: priority} or a list of {name, priority}")
    out: dict[str, int] = {}
    for name, priority in items:
        if not isinstance(name, str) or not name or isinstance(priority, bool) \
                or not isinstance(priority, int):
            raise ObjectivesError(f"objective {name!r}: priority must be an integer")
        out[name] = priority
    return Objectives(out)


def _pair(item: Any) -> tuple[Any, Any]:
    if not isinstance(item, dict):
        raise ObjectivesError(f"objective entry {item!r} is not a mapping")
    if "spec" in item:  # an InferenceObjective object
        return (item.get("metadata") or {}).get("name"), (item["spec"] or {}).get("priority", 0)
    return item.get("name"), item.get("priority", 0)


def load_objectives(path: str | Path | None) -> Objectives:
    """The file's objectives (YAML or JSON, several documents allowed); none without a path."""
    if not path:
        return Objectives()
    try:
        docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise ObjectivesError(f"cannot read objectives file {path}: {exc}") from None
    merged: dict[str, int] = {}
    for doc in docs:
        merged.update(parse_objectives(doc).priorities)
    return Objectives(merged)


@dataclass(frozen=True)
class Saturation:
    """A replica is saturated when its queue or its KV cache is over the limit; the pool is when
    every eligible replica is (GIE's saturation detector, on the heartbeat's figures)."""

    queue_depth: int = 8  # requests (running + waiting) per replica
    kv_usage: float = 0.8

    def saturated(self, cands: Sequence[Candidate]) -> bool:
        return bool(cands) and all(
            c.load >= self.queue_depth or c.kv_cache_usage >= self.kv_usage for c in cands)
