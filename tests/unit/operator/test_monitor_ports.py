"""The ServiceMonitor and PodMonitor scrape a port the objects they select actually name: each
monitor's selector is evaluated against the Services and pod templates the operator builds."""

from __future__ import annotations

import pytest

from kvserve.operator.children import build_children


def cr(**spec: object) -> dict:
    base = {"model": {"name": "llama-3-8b"}, "gpu": {"type": "L40S"},
            "monitoring": {"serviceMonitor": True, "podMonitor": True}}
    base.update(spec)
    return {"apiVersion": "kvserve.io/v1alpha1", "kind": "KVInferenceService",
            "metadata": {"name": "chat", "namespace": "ml", "uid": "uid-9"}, "spec": base}


def matches(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics (matchLabels and the In/NotIn/Exists expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": e["key"] in labels, "DoesNotExist": e["key"] not in labels}[op]
        if not ok:
            return False
    return True


def pod_templates(objs: list[dict]) -> list[dict]:
    return [o["spec"]["template"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("router", [True, False])
def test_the_service_monitor_port_is_a_port_of_every_service_it_selects(router: bool) -> None:
    objs = build_children(cr(router={"enabled": router})).objects
    (sm,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    selected = [o for o in objs if o["kind"] == "Service"
                and matches(sm["spec"]["selector"], o["metadata"]["labels"])]
    assert selected, "the ServiceMonitor selects no Service"
    for endpoint in sm["spec"]["endpoints"]:
        for svc in selected:
            names = {p.get("name") for p in svc["spec"]["ports"]}
            assert endpoint["port"] in names, (svc["metadata"]["name"], names)


@pytest.mark.parametrize("router", [True, False])
def test_the_pod_monitor_port_is_a_container_port_of_every_pod_it_selects(router: bool) -> None:
    objs = build_children(cr(router={"enabled": router})).objects
    (pm,) = [o for o in objs if o["kind"] == "PodMonitor"]
    selected = [t for t in pod_templates(objs)
                if matches(pm["spec"]["selector"], t["metadata"]["labels"])]
    components = {t["metadata"]["labels"]["app.kubernetes.io/component"] for t in selected}
    assert components == ({"engine", "router"} if router else {"engine"})
    for endpoint in pm["spec"]["podMetricsEndpoints"]:
        for tpl in selected:
            names = {p.get("name") for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
            assert endpoint["port"] in names, names
