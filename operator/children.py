"""A KVInferenceService object -> every child object, owned: the one path the kopf handlers and
`kvserve render` both take, so a dry run cannot drift from what the operator applies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from kvserve.operator.inference_pool import share_pool_ownership
from kvserve.operator.model_files import ModelReader
from kvserve.operator.pd_roles import disaggregate, plan_roles, status_sizing
from kvserve.operator.resources import desired_objects, registration_secret
from kvserve.operator.sizing import Sizing, plan
from kvserve.operator.spec import ServiceSpec, parse_spec
from kvserve.operator.trust import new_token


@dataclass(frozen=True)
class Children:
    spec: ServiceSpec
    sizing: Sizing
    objects: list[dict[str, Any]]
    # Created when missing, never applied again (the registration Secret: a reconcile must not
    # rotate its token); `kvserve render` does not print them.
    create_once: list[dict[str, Any]]


def build_children(body: Mapping[str, Any], reader: ModelReader | None = None) -> Children:
    """Parse, size and build; InvalidSpecError says what to fix. With a reader, a model outside
    the catalog is sized from its own files. Owner references (kopf.adopt) need the uid the API
    server assigned, so a CR read from a file gets none."""
    spec = parse_spec(dict(body), reader)
    if spec.disaggregation is None:
        sizing = plan(spec)
        objects = desired_objects(spec, sizing)
    else:  # prefill and decode pools, each sized for its role
        plans = plan_roles(spec)
        sizing = status_sizing(plans)
        objects = disaggregate(spec, desired_objects(spec, sizing), plans)
    create_once = [registration_secret(spec, new_token())]
    if spec.uid:
        kopf.adopt(objects + create_once, owner=dict(body))
        share_pool_ownership(objects)
    return Children(spec, sizing, objects, create_once)
