"""Idempotent apply: subset comparison, the applied hash, conditions and readiness."""

from __future__ import annotations

from kvserve.operator.conditions import Condition, merge_conditions, readiness, same_conditions
from kvserve.operator.reconcile import APPLIED_HASH, is_subset, stamped, up_to_date


def test_server_defaults_do_not_count_as_differences() -> None:
    desired = {"spec": {"replicas": 2, "template": {"containers": [{"name": "e", "args": ["a"]}]}}}
    actual = {"spec": {"replicas": 2, "revisionHistoryLimit": 10, "template": {"containers": [
        {"name": "e", "args": ["a"], "terminationMessagePath": "/dev/termination-log"}]}}}
    assert is_subset(desired, actual)


def test_canonical_quantities_are_equal() -> None:
    assert is_subset({"memory": "1024Mi", "cpu": 2, "nvidia.com/gpu": "1"},
                     {"memory": "1Gi", "cpu": "2", "nvidia.com/gpu": "1"})
    assert not is_subset({"memory": "2Gi"}, {"memory": "1Gi"})


def test_bools_are_not_numbers() -> None:
    assert not is_subset({"x": True}, {"x": 1})
    assert not is_subset({"x": 0}, {"x": False})


def deployment(node_selector: dict | None) -> dict:
    pod: dict = {"containers": [{"name": "e"}]}
    if node_selector is not None:
        pod["nodeSelector"] = node_selector
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "ml"}, "spec": {"template": {"spec": pod}}}


def test_a_removed_field_changes_the_hash_so_it_is_applied() -> None:
    """A subset check alone would call the old object (with the nodeSelector) up to date."""
    live = stamped(deployment({"gpu": "a100"}))
    desired = stamped(deployment(None))
    assert is_subset(desired["spec"], live["spec"])
    assert not up_to_date(desired, live)
    assert up_to_date(stamped(deployment({"gpu": "a100"})), live)


def test_a_hand_edit_of_an_applied_field_is_repaired() -> None:
    live = stamped(deployment({"gpu": "a100"}))
    live["spec"]["template"]["spec"]["nodeSelector"]["gpu"] = "l4"
    assert not up_to_date(stamped(deployment({"gpu": "a100"})), live)


def test_the_hash_is_not_in_the_pod_template() -> None:
    obj = stamped(deployment({"gpu": "a100"}))
    assert APPLIED_HASH in obj["metadata"]["annotations"]
    assert "annotations" not in obj["spec"]["template"].get("metadata", {})


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


def test_a_value_and_a_missing_or_other_typed_value_differ() -> None:
    """Found by the mutation run (docs/mutation.md): the fallback when nothing else matched."""
    assert not is_subset({"x": None}, {"x": "y"})
    assert not is_subset({"x": "y"}, {"x": None})
    assert not is_subset({"memory": "1Gi"}, {"memory": None})
    assert not is_subset({"memory": "1Gi"}, {"memory": ["1Gi"]})
    assert is_subset({"x": None}, {"x": None})
