"""A KVInferenceService object -> every child object, owned: the one path the kopf handlers and
`kvserve render` both take, so a dry run cannot drift from what the operator applies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvserve.operator.resources import desired_objects
from kvserve.operator.sizing import Sizing, plan
from kvserve.operator.spec import ServiceSpec, parse_spec


@dataclass(frozen=True)
class Children:
    spec: ServiceSpec
    sizing: Sizing
    objects: list[dict[str, Any]]


def build_children(body: Mapping[str, Any]) -> Children:
    """Parse, size and build; InvalidSpecError says what to fix. Owner references (kopf.adopt)
    need the uid the API server assigned, so a CR read from a file gets none."""
    spec = parse_spec(dict(body))
    sizing = plan(spec)
    objects = desired_objects(spec, sizing)
    if spec.uid:
        kopf.adopt(objects, owner=dict(body))
    return Children(spec, sizing, objects)
