"""InferencePool + pods -> endpoints: the selector's Ready pods at each target port."""

from __future__ import annotations

from kvserve.service.epp.pool import pod_ready, pool_endpoints

POOL = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "chat", "namespace": "llm"},
        "spec": {"selector": {"matchLabels": {"app": "kvserve", "kvserve.io/service": "chat"}},
                 "targetPorts": [{"number": 8000}],
                 "endpointPickerRef": {"name": "chat-epp", "port": {"number": 9002}}}}
LABELS = {"app": "kvserve", "kvserve.io/service": "chat", "pod-template-hash": "x"}


def pod(ip: str, labels: dict = LABELS, ready: str = "True", deleting: bool = False) -> dict:
    meta = {"name": f"p-{ip}", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "phase": "Running",
                                          "conditions": [{"type": "Ready", "status": ready}]}}


def test_ready_matching_pods_at_the_target_port():
    pods = [pod("10.0.0.2"), pod("10.0.0.1"), pod("10.0.0.3", ready="False"),
            pod("10.0.0.4", deleting=True), pod("10.0.0.5", labels={"app": "kvserve"}),
            pod("10.0.0.6", labels={**LABELS, "kvserve.io/service": "other"})]
    assert pool_endpoints(POOL, pods) == ("10.0.0.1:8000", "10.0.0.2:8000")


def test_every_target_port_and_ipv6():
    pool = {**POOL, "spec": {**POOL["spec"], "targetPorts": [{"number": 8000},
                                                              {"number": 8001}]}}
    assert pool_endpoints(pool, [pod("fd00::7")]) == ("[fd00::7]:8000", "[fd00::7]:8001")


def test_an_empty_selector_or_no_port_selects_nothing():
    no_selector = {**POOL, "spec": {**POOL["spec"], "selector": {"matchLabels": {}}}}
    no_ports = {**POOL, "spec": {**POOL["spec"], "targetPorts": []}}
    assert pool_endpoints(no_selector, [pod("10.0.0.1")]) == ()
    assert pool_endpoints(no_ports, [pod("10.0.0.1")]) == ()


def test_pod_ready_needs_an_ip_and_the_condition():
    assert pod_ready(pod("10.0.0.1"))
    assert not pod_ready({"metadata": {}, "status": {"conditions": [{"type": "Ready",
                                                                      "status": "True"}]}})
    assert not pod_ready({"metadata": {}, "status": {"podIP": "10.0.0.1"}})
