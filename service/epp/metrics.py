"""The EPP's own Prometheus metrics (`kvserve_epp:*`), served with the router core's
(`kvserve_router:*`) on --metrics-port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class _Forward:
    """Collects another registry's metrics into this one (the router core's)."""

    def __init__(self, other: CollectorRegistry) -> None:
        self.other = other

    def collect(self):
        yield from self.other.collect()


class EppMetrics:
    """One registry per EPP (no process-global state)."""

    def __init__(self, router_registry: CollectorRegistry | None = None) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter(
            "kvserve_epp:decisions", "Requests answered, by reason: prefix, least-load, "
            "round-robin, session, adapter (the policy that picked), no_endpoint (503), shed "
            "(429), bad_request (400)", ["reason"], registry=r)
        self.pick_seconds = Histogram(
            "kvserve_epp:pick_seconds", "Time to pick an endpoint once the body is complete "
            "(tokenize, Redis lookup, score)", registry=r,
            buckets=(5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2,
                     2.5e-2, 5e-2, 0.1, 0.25, 1.0))
        self.endpoints = Gauge("kvserve_epp:endpoints", "Endpoints known (eligible to pick)",
                               registry=r)
        self.shed = Counter("kvserve_epp:shed_requests", "Requests shed with 429 (sheddable "
                            "objective, pool saturated)", ["objective"], registry=r)
        self.served_elsewhere = Counter(
            "kvserve_epp:served_elsewhere", "Responses the data plane says another endpoint "
            "served than the one picked first (a fallback)", registry=r)
        self.tokens = Counter("kvserve_epp:tokens", "Tokens of answered requests, from the "
                              "response's usage, by kind (prompt, completion)", ["kind"],
                              registry=r)
        self.streams = Gauge("kvserve_epp:streams", "ext_proc streams open", registry=r)
        if router_registry is not None:
            r.register(_Forward(router_registry))
