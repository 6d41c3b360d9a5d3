"""The engine Deployment's lifecycle lets a rolling update lose no stream (issue 41): the
preStop sleep, the replica's drain timeout (read back through the real `kvserve serve` parser)
and a hand-back margin all fit in terminationGracePeriodSeconds, the readiness probe is the
endpoint that turns 503 while draining, and no old pod stops before its successor is ready."""

from __future__ import annotations

import pytest
from test_resources import load, objects, variants

from kvserve.operator.resources import HANDBACK_MARGIN_SECONDS


def engine_pods(body: dict) -> list[dict]:
    """The engine Deployments (one, or a prefill and a decode pool), or a multi-node replica's
    leader pod template (same shape)."""
    found = [o for o in objects(body) if o["kind"] in ("Deployment", "LeaderWorkerSet")
             and o["metadata"]["name"].endswith(("-engine", "-prefill", "-decode"))]
    assert found, "no engine workload rendered"
    return [{"spec": {"template": o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]}}
            if o["kind"] == "LeaderWorkerSet" else o for o in found]


def engine_pod(body: dict) -> dict:
    (deploy,) = engine_pods(body)
    return deploy


@pytest.mark.parametrize("name, body", variants(), ids=[n for n, _ in variants()])
def test_the_grace_period_holds_the_presleep_the_drain_and_the_hand_back(name, body) -> None:
    from kvserve.service.cli import build_parser

    for workload in engine_pods(body):
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        drain = build_parser().parse_args(container["args"]).shutdown_grace_period
        assert drain > 0  # --drain-timeout
        assert pod["terminationGracePeriodSeconds"] >= (
            float(sleep[1]) + drain + HANDBACK_MARGIN_SECONDS), (sleep, drain)


def test_readiness_is_the_health_endpoint_that_says_draining() -> None:
    container = engine_pod(load("llama-2-7b-a100.yaml"))["spec"]["template"]["spec"][
        "containers"][0]
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/health", "http")


def test_a_rolling_update_starts_the_new_pod_before_stopping_an_old_one() -> None:
    strategy = engine_pod(load("llama-2-7b-a100.yaml"))["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


def test_drain_timeout_is_the_grace_period_flag() -> None:
    from kvserve.service.cli import build_parser

    a = build_parser().parse_args(["serve", "m", "--drain-timeout", "42"])
    b = build_parser().parse_args(["serve", "m", "--shutdown-grace-period", "42"])
    assert a.shutdown_grace_period == b.shutdown_grace_period == 42.0
