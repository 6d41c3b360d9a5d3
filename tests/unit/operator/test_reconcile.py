"""Idempotent apply: subset comparison, minimal merge patches, conditions and readiness."""

from __future__ import annotations

from kvserve.operator.conditions import Condition, merge_conditions, readiness, same_conditions
from kvserve.operator.reconcile import is_subset, merge_patch


def test_server_defaults_do_not_count_as_differences() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "e", "args": ["a"]}]}}}
    actual = {"spec": {"replicas": 2, "revisionHistoryLimit": 10, "template": {"containers": [
        {"name": "e", "args": ["a"], "terminationMessagePath": "/dev/termination-log"}]}}}
    assert is_subset(desired, actual)
    assert merge_patch(desired, actual) == {}


def test_canonical_quantities_are_equal() -> None:
    assert is_subset({"memory": "1024Mi", "cpu": 2, "nvidia.com/gpu": "1"},
                     {"memory": "1Gi", "cpu": "2", "nvidia.com/gpu": "1"})
    assert not is_subset({"memory": "2Gi"}, {"memory": "1Gi"})


def test_bools_are_not_numbers() -> None:
    assert not is_subset({"x": True}, {"x": 1})
    assert not is_subset({"x": 0}, {"x": False})


def test_patch_holds_only_what_differs_and_whole_lists() -> None:
    desired = {"spec": {"replicas": 3, "template": {"containers": [{"args": ["--x", "2"]}]}},
               "metadata": {"labels": {"a": "1"}}}
    actual = {"spec": {"replicas": 2, "template": {"containers": [{"args": ["--x", "1"]}]}},
              "metadata": {"labels": {"a": "1", "b": "2"}}}
    assert merge_patch(desired, actual) == {
        "spec": {"replicas": 3, "template": {"containers": [{"args": ["--x", "2"]}]}}}


def test_list_length_change_is_a_difference() -> None:
    assert not is_subset({"args": ["a"]}, {"args": ["a", "b"]})


def test_transition_time_moves_only_on_a_flip() -> None:
    first = merge_conditions([], [Condition("Ready", "False", "Progressing", "0/1")], 1, "t1")
    same = merge_conditions(first, [Condition("Ready", "False", "Progressing", "0/1")], 1, "t2")
    flipped = merge_conditions(same, [Condition("Ready", "True", "ReplicasReady", "1/1")], 1, "t3")
    assert first[0]["lastTransitionTime"] == same[0]["lastTransitionTime"] == "t1"
    assert same_conditions(first, same)
    assert flipped[0]["lastTransitionTime"] == "t3" and flipped[0]["observedGeneration"] == 1


def test_readiness_from_the_deployment_status() -> None:
    assert readiness(None, 2).condition.status == "False"
    progressing = readiness({"status": {"replicas": 2, "readyReplicas": 1,
                                        "updatedReplicas": 2}}, 2)
    assert (progressing.condition.reason, progressing.ready_replicas) == ("Progressing", 1)
    ready = readiness({"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}}, 2)
    assert (ready.condition.status, ready.replicas) == ("True", 2)
    assert readiness({"status": {}}, 0).condition.reason == "ScaledToZero"
