"""One pick: the router's own decision (service/router/routing.py: Redis prefix index, load,
overload guard, LoRA affinity, host-tier hits), narrowed to the endpoints the data plane and the
pool allow, then shed (429) or refused (503) as the GIE protocol says. Under `--policy pd` a
remote prefill names the prefill replica too (llm-d's `x-prefiller-host-port`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.service.epp.endpoints import endpoint_of
from kvserve.service.epp.messages import OBJECTIVE_HEADER
from kvserve.service.epp.metrics import EppMetrics
from kvserve.service.epp.objectives import Objectives, Saturation
from kvserve.service.router import pd
from kvserve.service.router.adapters import AdapterLoadError
from kvserve.service.router.routing import RouteInfo, Router
from kvserve.service.routing_policy import Candidate


@dataclass(frozen=True)
class Pick:
    """The outcome: endpoints best first (status 200), or a refusal (503, 429, 400)."""

    status: int
    reason: str  # the policy that picked, or no_endpoint / shed / bad_request
    endpoints: tuple[str, ...] = ()
    replica_id: str | None = None  # the chosen replica (its in-flight count was taken)
    message: str = ""
    prefill: str | None = None  # --policy pd: the prefill replica's endpoint (remote prefill)

    @property
    def value(self) -> str:
        """The x-gateway-destination-endpoint value."""
        return ",".join(self.endpoints)


class Picker:
    """Wraps one Router (its replica set, tokenizer and policy); one per EPP process."""

    def __init__(self, router: Router, metrics: EppMetrics, objectives: Objectives = Objectives(),
                 saturation: Saturation = Saturation(), fallback_list: bool = False) -> None:
        self.router, self.metrics = router, metrics
        self.objectives, self.saturation = objectives, saturation
        self.fallback_list = fallback_list
        # The endpoints an InferencePool selects (service/epp/pool.py); None: no pool, any.
        self.allowed: frozenset[str] | None = None

    async def pick(self, path: str, body: dict[str, Any] | None, headers: Mapping[str, str],
                   subset: frozenset[str] | None = None) -> Pick:
        start = time.perf_counter()
        route = await self.router.route(path, body, headers) if body is not None else None
        ranking = list(route.decision.ranking) if route else self.router.least_load_ranking()
        eligible = self._eligible(ranking, subset)
        pick = await self._decide(route, eligible, headers)
        self.metrics.pick_seconds.observe(time.perf_counter() - start)
        self.metrics.decisions.labels(pick.reason).inc()
        if pick.replica_id is not None:
            self.router.replicas.acquire(pick.replica_id)
            self._count(route, eligible[0], pick.reason)
        return pick

    def _eligible(self, ranking: Sequence[Candidate], subset: frozenset[str] | None
                  ) -> list[Candidate]:
        allowed = self.allowed
        if subset is None and allowed is None:
            return list(ranking)
        return [c for c in ranking
                if (subset is None or endpoint_of(c.url) in subset)
                and (allowed is None or endpoint_of(c.url) in allowed)]

    async def _decide(self, route: RouteInfo | None, eligible: list[Candidate],
                      headers: Mapping[str, str]) -> Pick:
        if not eligible:
            return Pick(503, "no_endpoint", message="no eligible endpoint: no replica is known, "
                        "or none is in the data plane's subset / the pool")
        objective = headers.get(OBJECTIVE_HEADER)
        if self.objectives.sheddable(objective) and self.saturation.saturated(eligible):
            self.metrics.shed.labels(objective or "").inc()
            return Pick(429, "shed", message=f"the pool is saturated; objective {objective!r} "
                        "has a negative priority and is shed")
        reason = route.decision.applied if route else "least-load"
        if route is not None and route.adapter is not None:
            try:
                eligible = await self._adapter_first(route, eligible, headers)
            except AdapterLoadError as exc:
                return Pick(503, "no_endpoint", message=str(exc))
            reason = "adapter"
        chosen = eligible if self.fallback_list else eligible[:1]
        return Pick(200, reason, tuple(endpoint_of(c.url) for c in chosen),
                    eligible[0].replica_id, prefill=self._prefill(route, eligible[0]))

    def _prefill(self, route: RouteInfo | None, decode: Candidate) -> str | None:
        """--policy pd: the prefill endpoint when the plan prefills remotely for the replica
        picked (one the pool allows); None: the decode replica prefills locally."""
        plan = route.pd_plan if route is not None else None
        if plan is None:
            return None
        decision = plan.decision
        if route.adapter is not None and plan.remote:
            decision = pd.LOCAL_ADAPTER
        prefill = None
        if decision == pd.REMOTE:
            allowed = [c for c in plan.prefill if c.replica_id != decode.replica_id and
                       (self.allowed is None or endpoint_of(c.url) in self.allowed)]
            prefill = endpoint_of(allowed[0].url) if allowed else None
            decision = pd.REMOTE if prefill else pd.LOCAL_NO_PREFILLER
        self.router.metrics.pd_decisions.labels(decision).inc()
        return prefill

    async def _adapter_first(self, route: RouteInfo, eligible: list[Candidate],
                             headers: Mapping[str, str]) -> list[Candidate]:
        """The router's LoRA affinity: holders lead already; with no usable holder, have the
        adapter loaded where the route says (the router's own loader) and put that one first."""
        target = route.load_on
        if target is None or target.replica_id not in {c.replica_id for c in eligible}:
            return eligible
        rid = await self.router.adapters.ensure(route.adapter, target, dict(headers))
        return sorted(eligible, key=lambda c: c.replica_id != rid)

    def _count(self, route: RouteInfo | None, chosen: Candidate, reason: str) -> None:
        m = self.router.metrics
        m.requests.labels(chosen.replica_id, reason).inc()
        if route is not None and route.prompt_tokens:
            device, host = route.split(chosen.replica_id)
            m.matched_tokens.observe(device + host)
            m.matched_tokens_by_tier.labels("device").inc(device)
            m.matched_tokens_by_tier.labels("host").inc(host)
            m.prompt_tokens.inc(route.prompt_tokens)

    def release(self, replica_id: str) -> None:
        self.router.replicas.release(replica_id)

    def known_endpoints(self) -> int:
        """Endpoints a request could be sent to now (the pool's, when watching one)."""
        eps = {endpoint_of(i.url) for i in self.router.replicas.routable()}
        return len(eps if self.allowed is None else eps & self.allowed)
