"""The routing decision of one request: tokenize like the engine, ask Redis once how much of the
prompt each live replica holds, rank the replicas by the policy (service/routing_policy.py); a
request naming a LoRA adapter goes to its holders first, or says where to load it. Under
`--policy pd` the ranking is over the decode-capable replicas and the route carries the prefill
plan (service/router/pd.py)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from kvserve.service.prefix_index.extra_keys import block_extra_keys
from kvserve.service.router.adapters import Adapters
from kvserve.service.router.config import RouterConfig
from kvserve.service.router import pd
from kvserve.service.router.metrics import RouterMetrics
from kvserve.service.router.replicas import ReplicaSet
from kvserve.service.router.tokenizer import RouterTokenizer
from kvserve.service.routing_policy import (POLICIES, Candidate, Decision, decide,
                                            prefer_adapter)


@dataclass
class RouteInfo:
    decision: Decision
    prompt_tokens: int
    matched: dict[str, int]  # replica id -> predicted matched tokens (either tier)
    host_matched: dict[str, int] = field(default_factory=dict)  # of those, host-tier tokens
    adapter: str | None = None  # the LoRA adapter the request names
    load_on: Candidate | None = None  # where to load it first (no usable replica holds it)
    resident: bool = False  # the first-ranked replica holds the adapter
    pd_plan: pd.PDPlan | None = None  # --policy pd: remote or local prefill (service/router/pd.py)
    pd_decision: str | None = None  # what happened (pd.DECISIONS): the plan, or fallback
    pd_prefilled_by: str | None = None  # the prefill replica that did the prefill

    def split(self, replica_id: str) -> tuple[int, int]:
        """(device, host) predicted matched tokens of a replica, capped at the prompt."""
        matched = min(self.matched.get(replica_id, 0), self.prompt_tokens)
        host = min(self.host_matched.get(replica_id, 0), matched)
        return matched - host, host


class Router:
    """Chooses a replica per request; one per router process (its replica set and tokenizer)."""

    def __init__(self, cfg: RouterConfig) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {cfg.policy!r}; choose one of {POLICIES}")
        if not cfg.redis_url and not cfg.replicas:
            raise ValueError("the router needs replicas: pass --redis-url and/or --replicas")
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.replicas = ReplicaSet(cfg, self.metrics)
        self.prompts = RouterTokenizer(cfg.tokenizer, self.replicas, cfg.refresh_interval)
        self.adapters = Adapters(cfg.lora_modules, self.metrics, cfg.lora_load_timeout)
        # --policy pd: replica id -> when it may prefill again (it answered a prefill without
        # kv_transfer_params: no KV connector producing there).
        self.not_producers: dict[str, float] = {}
        # A random start, so several routers' tie-break rotations are not in lockstep.
        self.counter = random.randrange(1 << 30)

    async def start(self) -> None:
        await self.replicas.start()
        if self.cfg.policy in ("prefix", "pd"):
            await self.prompts.start()
        self.replicas.update_gauges()

    async def close(self) -> None:
        await self.prompts.close()
        await self.replicas.close()

    async def route(self, path: str, body: dict[str, Any], headers: Any) -> RouteInfo:
        start = time.perf_counter()
        replicas = self.replicas
        block_size = replicas.block_size()
        is_pd = self.cfg.policy == "pd"
        use_index = self.cfg.policy in ("prefix", "pd") and replicas.index is not None and \
            replicas.redis_up
        adapter = self.adapters.adapter_of(body.get("model"), replicas.known)
        # pd needs the prompt's length even without the index (its threshold)
        tokens = self.prompts.prompt_tokens(path, body) if use_index or is_pd else None
        hashes: list[str] = []
        if tokens:
            from kvserve.engine.core.block_hash import block_hashes

            hashes = block_hashes(tokens, block_size,
                                  block_extra_keys(body.get("cache_salt"), adapter))
        # Only prefix routing needs Redis per request; the others use the set refreshed each second.
        counts = await replicas.match_counts(hashes) if use_index else {}
        everyone = replicas.candidates(counts)
        cands = pd.decode_capable(everyone) if is_pd else everyone
        policy = self.cfg.policy if (use_index or self.cfg.policy not in ("prefix", "pd")) \
            else "least-load"
        session = headers.get(self.cfg.session_header) or body.get("user")
        self.counter += 1
        decision = decide(policy, cands, num_blocks=len(hashes), block_size=block_size,
                          cfg=self.cfg.policy_cfg, counter=self.counter, session_key=session)
        if is_pd:  # prefill-only replicas last: a fallback when every decode replica fails
            ids = {c.replica_id for c in cands}
            decision = Decision(decision.ranking + tuple(
                c for c in everyone if c.replica_id not in ids), decision.policy,
                decision.applied)
        route = RouteInfo(decision, len(tokens or ()),
                          {rid: n * block_size for rid, (n, _) in counts.items()},
                          {rid: h * block_size for rid, (_, h) in counts.items()})
        if adapter is not None:
            self._prefer_adapter(route, adapter)
        if is_pd:
            route.pd_plan = pd.plan(route.decision.chosen, everyone,
                                    None if tokens is None else len(tokens), block_size,
                                    self.cfg.pd, self.cfg.policy_cfg, len(hashes), self.counter,
                                    self._not_producers())
        self.metrics.decision_seconds.observe(time.perf_counter() - start)
        return route

    def not_a_producer(self, replica_id: str) -> None:
        """A prefill replica answered without transfer parameters: not asked for a while."""
        self.not_producers[replica_id] = time.monotonic() + pd.NOT_A_PRODUCER_S

    def _not_producers(self) -> set[str]:
        if not self.not_producers:
            return set()
        now = time.monotonic()
        self.not_producers = {r: t for r, t in self.not_producers.items() if t > now}
        return set(self.not_producers)

    def _prefer_adapter(self, route: RouteInfo, adapter: str) -> None:
        """The adapter's holders first; `load_on` when the router must have it loaded."""
        holders = self.adapters.holders(adapter, self.replicas.known)
        d = route.decision
        ranked, load_on = prefer_adapter(d.ranking, holders, self.cfg.policy_cfg,
                                         can_load=self.adapters.registered(adapter))
        route.decision = Decision(tuple(ranked), d.policy, d.applied)
        route.adapter, route.load_on = adapter, load_on
        route.resident = bool(ranked) and ranked[0].replica_id in holders

    def least_load_ranking(self) -> list[Candidate]:
        """Every replica by load: for requests that are not routed by their prompt."""
        self.counter += 1
        return list(decide("least-load", self.replicas.candidates({}),
                           counter=self.counter).ranking)
