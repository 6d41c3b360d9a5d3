"""The router's own Prometheus metrics (`kvserve_router:*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    """The router's own Prometheus registry (no process-global state)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.redis_up = Gauge("kvserve_router:redis_up", "1 when the prefix index is reachable",
                              registry=r)
        self.replicas_up = Gauge("kvserve_router:replicas_up", "Routable replicas", registry=r)
        self.replicas_ignored = Gauge(
            "kvserve_router:replicas_ignored", "Replicas in Redis left out of routing (draining, "
            "malformed or unsigned heartbeat)", registry=r)
        self.requests = Counter("kvserve_router:requests", "Requests routed",
                                ["replica", "policy"], registry=r)
        self.matched_tokens = Histogram(
            "kvserve_router:predicted_matched_tokens", "Prompt tokens predicted to hit the cache "
            "of the chosen replica", registry=r,
            buckets=(0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384))
        self.matched_tokens_by_tier = Counter(
            "kvserve_router:predicted_matched_tokens_by_tier", "Prompt tokens of routed requests "
            "predicted to hit the chosen replica's cache, by the tier holding them (device, host)",
            ["tier"], registry=r)
        self.prompt_tokens = Counter("kvserve_router:prompt_tokens",
                                     "Prompt tokens of routed requests", registry=r)
        self.decision_seconds = Histogram(
            "kvserve_router:routing_decision_seconds", "Time to choose a replica (tokenize, "
            "Redis lookup, score)", registry=r,
            # Fine below 5 ms, so a p99 near the 2 ms target can be read off the histogram.
            buckets=(5e-5, 1e-4, 2e-4, 3e-4, 4e-4, 5e-4, 7.5e-4, 1e-3, 1.25e-3, 1.5e-3, 2e-3,
                     2.5e-3, 3e-3, 4e-3, 5e-3, 7.5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0))
        self.redis_errors = Counter("kvserve_router:redis_errors", "Failed Redis calls",
                                    registry=r)
        self.retries = Counter("kvserve_router:retries", "Requests retried on another replica",
                               ["replica"], registry=r)
        self.upstream_errors = Counter("kvserve_router:upstream_errors",
                                       "Replica failures", ["replica", "stage"], registry=r)
        self.client_disconnects = Counter(
            "kvserve_router:client_disconnects", "Requests whose client left before the end; "
            "the replica's connection is closed so it aborts", registry=r)
        self.adapter_requests = Counter(
            "kvserve_router:adapter_requests", "Requests naming a LoRA adapter, by outcome: "
            "resident (sent to a replica holding it), loaded (the router had it loaded first), "
            "unknown (not registered and held by no replica: the replica answers 404); adapters "
            "not registered with --lora-modules count under adapter=\"unregistered\"",
            ["adapter", "outcome"], registry=r)
        self.adapter_loads = Counter(
            "kvserve_router:adapter_loads", "Adapter loads the router asked a replica for, by "
            "result (ok, failed)", ["adapter", "result"], registry=r)
        self.adapter_load_seconds = Histogram(
            "kvserve_router:adapter_load_seconds", "Time for a replica to load an adapter the "
            "router asked for", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
        self.migrations = Counter(
            "kvserve:router_migrations", "In-flight generations moved to another replica after "
            "theirs broke, by reason (reset, eof, error_event, drain) and outcome (migrated; "
            "retried: a whole request re-issued; limit, too_long, no_replica: the stream ended "
            "with an error)", ["reason", "outcome"], registry=r)
        self.pd_decisions = Counter(
            "kvserve:router_pd_decisions", "--policy pd: where each request's prompt was "
            "prefilled: remote (a prefill replica, blocks handed to the decode replica), "
            "local_short (uncached part within --pd-threshold), local_busy (prefill queues above "
            "--pd-max-prefill-queue), local_no_prefiller, local_unknown_prompt (not tokenized), "
            "fallback (the remote prefill failed or gave no kv_transfer_params: local prefill)",
            ["decision"], registry=r)
        self.pd_prefill_seconds = Histogram(
            "kvserve:router_pd_prefill_seconds", "--policy pd: time of a remote prefill (the "
            "prefill replica's answer), successful or not", registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.draining = Gauge("kvserve_router:draining", "1 while the router drains (SIGTERM)",
                              registry=r)

