"""Objectives (name -> priority) from their file forms, and when the pool counts as saturated."""

from __future__ import annotations

import pytest

from kvserve.service.epp.objectives import (Objectives, ObjectivesError, Saturation,
                                            load_objectives, parse_objectives)
from kvserve.service.routing_policy import Candidate


def test_the_forms_agree():
    want = {"chat": 10, "batch": -1}
    assert parse_objectives(want).priorities == want
    assert parse_objectives([{"name": "chat", "priority": 10},
                             {"name": "batch", "priority": -1}]).priorities == want
    assert parse_objectives({"objectives": [{"name": "chat", "priority": 10},
                                            {"name": "batch", "priority": -1}]}).priorities == want


def test_inference_objective_objects_in_a_yaml_file(tmp_path):
    path = tmp_path / "objectives.yaml"
    path.write_text("apiVersion: inference.networking.x-k8s.io/v1alpha2\n"
                    "kind: InferenceObjective\nmetadata: {name: batch}\nspec: {priority: -5}\n"
                    "---\n"
                    "apiVersion: inference.networking.x-k8s.io/v1alpha2\n"
                    "kind: InferenceObjective\nmetadata: {name: chat}\nspec: {priority: 3}\n")
    obj = load_objectives(path)
    assert obj.priorities == {"batch": -5, "chat": 3}
    assert obj.sheddable("batch") and not obj.sheddable("chat")
    assert not obj.sheddable("unknown") and not obj.sheddable(None)


@pytest.mark.parametrize("bad", [{"x": "high"}, [{"name": "x", "priority": 1.5}], "x", [3],
                                 {"x": True}])
def test_bad_objectives_are_refused(bad):
    with pytest.raises(ObjectivesError):
        parse_objectives(bad)


def test_unreadable_file(tmp_path):
    with pytest.raises(ObjectivesError, match="cannot read"):
        load_objectives(tmp_path / "missing.yaml")
    assert load_objectives(None) == Objectives()


def test_saturated_only_when_every_replica_is():
    sat = Saturation(queue_depth=4, kv_usage=0.8)
    busy, full, cool = Candidate("a", "u", load=4), Candidate("b", "u", kv_cache_usage=0.9), \
        Candidate("c", "u", load=3, kv_cache_usage=0.5)
    assert sat.saturated([busy, full])
    assert not sat.saturated([busy, full, cool])
    assert not sat.saturated([])
