"""Traffic in from outside the cluster: an Ingress and a Gateway API HTTPRoute, both aimed at the
entry Service (the router, or the engine when the router is off)."""

from __future__ import annotations

from typing import Any

from kvserve.operator.spec import ServiceSpec

Obj = dict[str, Any]


def ingress(spec: ServiceSpec, meta: Obj, service: str) -> Obj | None:
    i = spec.ingress
    if i is None:
        return None
    backend = {"service": {"name": service, "port": {"name": "http"}}}
    body: Obj = {"rules": [{"host": i.host, "http": {"paths": [
        {"path": i.path, "pathType": "Prefix", "backend": backend}]}}]}
    if i.class_name:
        body["ingressClassName"] = i.class_name
    if i.tls_secret:
        body["tls"] = [{"hosts": [i.host], "secretName": i.tls_secret}]
    if i.annotations:
        meta = {**meta, "annotations": dict(i.annotations)}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta,
            "spec": body}


def http_route(spec: ServiceSpec, meta: Obj, service: str, port: int) -> Obj | None:
    g = spec.gateway
    if g is None:
        return None
    body: Obj = {"parentRefs": [dict(ref) for ref in g.parent_refs],
                 "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                            "backendRefs": [{"name": service, "port": port}]}]}
    if g.hostnames:
        body["hostnames"] = list(g.hostnames)
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": meta,
            "spec": body}
