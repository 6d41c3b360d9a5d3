"""Prometheus metrics of one server (vLLM's names, label model_name), on a registry per instance.

Engine figures are read from `engine.get_stats()` in the engine thread after each step; request
latencies (TTFT, inter-token, end-to-end) are timed there too, as outputs come out of `step()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM's (seconds), so dashboards built for vLLM read ours unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ALLOC_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                 1e-2, 2.5e-2, 0.1)


@dataclass
class _RequestTimes:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    counted_prompt: bool = False


def _stat(stats: Any, *names: str, default: float = 0.0) -> float:
    """The first of `names` that `stats` has (EngineStats fields), else `default`."""
    for name in names:
        value = getattr(stats, name, None)
        if value is not None:
            return value
    return default


class ServerMetrics:
    """Every metric of one server; thread-safe (prometheus-client locks), one registry each."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self._times: dict[str, _RequestTimes] = {}  # engine thread only
        self._last_counters: dict[str, float] = {}
        self._build_engine_metrics()
        self._build_request_metrics()
        self._build_tier_metrics()
        self._build_spec_metrics()
        # vLLM's: one series, its labels the adapters of running and waiting requests, its
        # value the time of the last change
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                               registry=self.registry)
        self._lora_labels: tuple[str, str, str] | None = None

    def _gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, ("model_name", *labels), registry=self.registry)

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, ("model_name", *labels), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ("model_name",), buckets=buckets, registry=self.registry)

    def _build_engine_metrics(self) -> None:
        m = self.model_name
        g, c = self._gauge, self._counter
        self.running = g("vllm:num_requests_running", "Requests in the running batch.").labels(m)
        self.waiting = g("vllm:num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.swapped = g("vllm:num_requests_swapped", "Requests swapped out to CPU.").labels(m)
        self.gpu_cache_usage = g("vllm:gpu_cache_usage_perc",
                                 "KV-cache usage, 0..1 (1 = every block in use).").labels(m)
        self.kv_cache_usage = g("vllm:kv_cache_usage_perc",
                                "KV-cache usage, 0..1 (vLLM's current name).").labels(m)
        self.prefix_hit_rate = g("vllm:prefix_cache_hit_rate",
                                 "Prefix cache hits / queries (tokens), since start.").labels(m)
        self.preemptions = c("vllm:num_preemptions", "Preemptions since start.").labels(m)
        self.prefix_queries = c("vllm:prefix_cache_queries",
                                "Prompt tokens looked up in the prefix cache.").labels(m)
        self.prefix_hits = c("vllm:prefix_cache_hits",
                             "Prompt tokens found in the prefix cache.").labels(m)
        self.external_queries = c("vllm:external_prefix_cache_queries", "Prompt tokens of the "
                                  "requests a KV connector was asked about.").labels(m)
        self.external_hits = c("vllm:external_prefix_cache_hits", "Prompt tokens a KV connector "
                               "supplied (pulled from a prefill replica).").labels(m)
        self.prompt_computed = c("kvserve:prompt_tokens_computed", "Prompt tokens run through "
                                 "the model (neither cached nor transferred).").labels(m)
        self.kv_transfer_blocks = c("kvserve:kv_transfer_blocks", "KV blocks moved between "
                                    "replicas by the KV connector.", ("direction",))
        self.kv_transfer_bytes = c("kvserve:kv_transfer_bytes", "KV bytes pulled from prefill "
                                   "replicas, by transport (tcp, or shm on one host).",
                                   ("transport",))
        self.kv_transfer_failures = c("kvserve:kv_transfer_failures", "KV pulls that failed and "
                                      "fell back to local prefill.").labels(m)
        self.kv_transfer_held = g("kvserve:kv_transfer_held_requests", "Finished requests whose "
                                  "blocks wait for a decode replica to pull them.").labels(m)
        self.cache_config = g("vllm:cache_config_info", "Information of the KV cache config.",
                              ("block_size", "num_gpu_blocks"))
        self.free_blocks = g("kvserve:free_blocks",
                             "KV blocks not held by any request (cached ones included).").labels(m)
        self.cached_blocks = g("kvserve:cached_blocks",
                               "KV blocks in the prefix cache (hash known).").labels(m)
        self.shared_blocks = g("kvserve:shared_blocks",
                               "KV blocks held by more than one request.").labels(m)
        self.total_blocks = g("kvserve:total_blocks", "KV blocks in the pool.").labels(m)
        self.model_weight_bytes = g(
            "kvserve:model_weight_bytes",
            "Bytes of model weights the engine holds (all ranks).").labels(m)
        self.block_alloc = self._histogram(
            "kvserve:block_allocation_seconds", "Time to allocate KV blocks for one request step.",
            ALLOC_BUCKETS).labels(m)

    def _build_request_metrics(self) -> None:
        m, h, c = self.model_name, self._histogram, self._counter
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token.",
                      TTFT_BUCKETS).labels(m)
        self.tpot = h("vllm:time_per_output_token_seconds", "Time per output token.",
                      ITL_BUCKETS).labels(m)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency.",
                     ITL_BUCKETS).labels(m)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                     E2E_BUCKETS).labels(m)
        self.prompt_tokens = c("vllm:prompt_tokens", "Prefill tokens processed.").labels(m)
        self.generation_tokens = c("vllm:generation_tokens",
                                   "Generation tokens processed.").labels(m)
        self.request_success = c("vllm:request_success", "Finished requests.",
                                 ("finished_reason",))

    def _build_tier_metrics(self) -> None:
        """The KV host tier (kv_offloading_size) and the swap pool: vLLM's CPU usage gauge plus
        kvserve:offload_* block and byte counters, and the prefix hits split by tier."""
        m, g, c = self.model_name, self._gauge, self._counter
        self.cpu_cache_usage = g("vllm:cpu_cache_usage_perc", "Host KV blocks in use (swap pool "
                                 "and host tier), 0..1.").labels(m)
        self.host_blocks = g("kvserve:offload_host_blocks", "Blocks the KV host tier holds.",
                             ("state",))
        self.offload_stored = c("kvserve:offload_blocks_stored", "KV blocks written to a tier.",
                                ("tier",))
        self.offload_restored = c("kvserve:offload_blocks_restored",
                                  "KV blocks copied from a tier back to the device.", ("tier",))
        self.offload_evicted = c("kvserve:offload_blocks_evicted",
                                 "KV blocks dropped from a tier to make room.", ("tier",))
        self.offload_bytes = c("kvserve:offload_bytes", "KV bytes moved between device and host "
                               "(offloads, restores, swaps), all ranks, and to and from the "
                               "disk tier.", ("direction",))
        self.disk_blocks = g("kvserve:offload_disk_blocks", "Blocks the KV disk tier holds.",
                             ("state",))
        self.disk_misses = c("kvserve:offload_disk_failures", "KV blocks the disk tier lost: "
                             "not written (writer behind) or found missing or damaged on read.",
                             ("reason",))
        self.restore_seconds = self._histogram(
            "kvserve:offload_restore_seconds", "Time of one step's batched host -> device restore.",
            ALLOC_BUCKETS + (0.25, 0.5, 1.0)).labels(m)
        self.prefix_hits_by_tier = c("kvserve:prefix_cache_hits_by_tier",
                                     "Prompt tokens found in the prefix cache, by tier.",
                                     ("tier",))
        self.prefix_hit_rate_by_tier = g("kvserve:prefix_cache_hit_rate_by_tier",
                                         "Prefix cache hits / queries (tokens) by tier, since "
                                         "start.", ("tier",))

    def _build_spec_metrics(self) -> None:
        """Speculative decoding (vLLM's names): drafts, draft tokens, accepted tokens, and
        accepted tokens by draft position."""
        m, c = self.model_name, self._counter
        self.spec_drafts = c("vllm:spec_decode_num_drafts",
                             "Requests x steps that scored speculative drafts.").labels(m)
        self.spec_draft_tokens = c("vllm:spec_decode_num_draft_tokens",
                                   "Draft tokens scored.").labels(m)
        self.spec_accepted = c("vllm:spec_decode_num_accepted_tokens",
                               "Draft tokens accepted.").labels(m)
        self.spec_accepted_per_pos = c("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft.",
                                       ("position",))

    def _observe_spec(self, stats: Any) -> None:
        self._advance("spec_drafts", self.spec_drafts, _stat(stats, "spec_decode_num_drafts"))
        self._advance("spec_draft_tokens", self.spec_draft_tokens,
                      _stat(stats, "spec_decode_num_draft_tokens"))
        self._advance("spec_accepted", self.spec_accepted,
                      _stat(stats, "spec_decode_num_accepted_tokens"))
        per_pos = getattr(stats, "spec_decode_accepted_per_pos", None) or ()
        for pos, value in enumerate(per_pos):
            self._advance(f"spec_pos_{pos}",
                          self.spec_accepted_per_pos.labels(self.model_name, str(pos)), value)

    def _observe_tiers(self, stats: Any) -> None:
        m = self.model_name
        self.cpu_cache_usage.set(_stat(stats, "cpu_cache_usage"))
        total, held = _stat(stats, "num_host_blocks"), _stat(stats, "num_host_cached_blocks")
        self.host_blocks.labels(m, "used").set(held)
        self.host_blocks.labels(m, "free").set(total - held)
        total, held = _stat(stats, "num_disk_blocks"), _stat(stats, "num_disk_cached_blocks")
        self.disk_blocks.labels(m, "used").set(held)
        self.disk_blocks.labels(m, "free").set(total - held)
        for key, counter in (("stored", self.offload_stored), ("restored", self.offload_restored),
                             ("evicted", self.offload_evicted)):
            for tier in ("host", "disk"):
                self._advance(f"{tier}_{key}", counter.labels(m, tier),
                              _stat(stats, f"{tier}_blocks_{key}"))
        for reason, key in (("dropped", "disk_blocks_dropped"), ("bad_file", "disk_bad_files")):
            self._advance(f"disk_{reason}", self.disk_misses.labels(m, reason), _stat(stats, key))
        for direction in ("to_host", "to_device", "to_disk", "from_disk"):
            self._advance(f"bytes_{direction}", self.offload_bytes.labels(m, direction),
                          _stat(stats, f"offload_bytes_{direction}"))
        queries, hits = _stat(stats, "prefix_cache_queries"), _stat(stats, "prefix_cache_hits")
        host, disk = _stat(stats, "prefix_cache_host_hits"), _stat(stats, "prefix_cache_disk_hits")
        for tier, value in (("device", hits - host - disk), ("host", host), ("disk", disk)):
            self._advance(f"hits_{tier}", self.prefix_hits_by_tier.labels(m, tier), value)
            self.prefix_hit_rate_by_tier.labels(m, tier).set(value / queries if queries else 0.0)

    # ---- engine side (engine thread) ---------------------------------------------------------
    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        self.cache_config.labels(self.model_name, str(block_size), str(num_gpu_blocks)).set(1)

    def set_model_weight_bytes(self, weight_bytes: int) -> None:
        """The weight bytes the engine holds (all ranks): the figure status.sizing.weightBytes
        and `kvserve plan` take from the checkpoint's headers."""
        self.model_weight_bytes.set(weight_bytes)

    def observe_stats(self, stats: Any) -> None:
        """Gauges from one EngineStats; cumulative engine counters become counter increments."""
        self.running.set(_stat(stats, "num_running"))
        self.waiting.set(_stat(stats, "num_waiting"))
        self.swapped.set(_stat(stats, "num_swapped"))
        usage = _stat(stats, "kv_cache_usage")
        self.gpu_cache_usage.set(usage)
        self.kv_cache_usage.set(usage)
        self.free_blocks.set(_stat(stats, "num_free_blocks"))
        self.cached_blocks.set(_stat(stats, "num_cached_blocks"))
        self.shared_blocks.set(_stat(stats, "num_shared_blocks"))
        self.total_blocks.set(_stat(stats, "num_total_blocks", "num_blocks"))
        self._advance("preemptions", self.preemptions, _stat(stats, "num_preemptions"))
        queries = _stat(stats, "prefix_cache_queries")
        hits = _stat(stats, "prefix_cache_hits")
        self._advance("queries", self.prefix_queries, queries)
        self._advance("hits", self.prefix_hits, hits)
        self.prefix_hit_rate.set(hits / queries if queries else 0.0)
        self._observe_tiers(stats)
        self._observe_spec(stats)
        self._observe_transfers(stats)

    def _observe_transfers(self, stats: Any) -> None:
        """The KV connector's figures (engine/kv_transfer/)."""
        m = self.model_name
        self._advance("external_queries", self.external_queries,
                      _stat(stats, "external_prefix_cache_queries"))
        self._advance("external_hits", self.external_hits,
                      _stat(stats, "external_prefix_cache_hits"))
        self._advance("prompt_computed", self.prompt_computed,
                      _stat(stats, "prompt_tokens_computed"))
        for direction in ("received", "sent"):
            self._advance(f"kvt_{direction}", self.kv_transfer_blocks.labels(m, direction),
                          _stat(stats, f"kv_transfer_blocks_{direction}"))
        for transport in ("tcp", "shm"):
            self._advance(f"kvt_bytes_{transport}", self.kv_transfer_bytes.labels(m, transport),
                          _stat(stats, f"kv_transfer_bytes_{transport}"))
        self._advance("kvt_failures", self.kv_transfer_failures,
                      _stat(stats, "kv_transfer_failures"))
        self.kv_transfer_held.set(_stat(stats, "kv_transfer_held_requests"))

    def _advance(self, key: str, counter: Any, cumulative: float) -> None:
        delta = cumulative - self._last_counters.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
        self._last_counters[key] = max(cumulative, self._last_counters.get(key, 0.0))

    def request_added(self, request_id: str, arrival: float) -> None:
        self._times[request_id] = _RequestTimes(arrival=arrival)

    def observe_outputs(self, outputs: Iterable[Any], now: float | None = None) -> None:
        """Token counts and latencies of one step's RequestOutputs (cumulative outputs)."""
        now = time.monotonic() if now is None else now
        generated = 0
        for out in outputs:
            t = self._times.get(out.request_id)
            if t is None:
                continue
            if not t.counted_prompt:
                self.prompt_tokens.inc(out.num_prompt_tokens)
                t.counted_prompt = True
            total = sum(len(c.token_ids) for c in out.outputs)
            generated += self._observe_tokens(t, total - t.num_tokens, now)
            if out.finished:
                reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
                self.request_finished(out.request_id, reasons[0] if reasons else "stop", now)
        if generated:  # one increment per step, not one per stream
            self.generation_tokens.inc(generated)

    def _observe_tokens(self, t: _RequestTimes, new: int, now: float) -> int:
        """Latencies of a request's `new` tokens; returns the count to add to the total."""
        if new <= 0:
            return 0
        if t.first_token is None:
            self.ttft.observe(now - t.arrival)
            t.first_token = now
        elif t.last_token is not None:
            gap = (now - t.last_token) / new
            self.tpot.observe(gap)
            self.itl.observe(gap)
        t.last_token = now
        t.num_tokens += new
        return new

    def request_finished(self, request_id: str, reason: str, now: float | None = None) -> None:
        """A request left the engine (finished or aborted): e2e latency and its finish reason."""
        t = self._times.pop(request_id, None)
        if t is None:
            return
        now = time.monotonic() if now is None else now
        self.e2e.observe(now - t.arrival)
        self.request_success.labels(self.model_name, reason).inc()

    # ---- EngineObserver (called by the AsyncEngine's thread) ---------------------------------
    def after_step(self, outputs: list[Any], stats: Any, events: list[Any], engine: Any) -> None:
        self.observe_outputs(outputs)
        self.observe_stats(stats)
        drain = getattr(engine, "drain_block_alloc_seconds", None)
        for seconds in drain() if drain is not None else ():
            self.block_alloc.observe(seconds)
        restores = getattr(engine, "drain_restore_seconds", None)
        for seconds in restores() if restores is not None else ():
            self.restore_seconds.observe(seconds)
        if getattr(getattr(engine, "config", None), "enable_lora", False):  # (an RPC when split)
            running, waiting = engine.lora_requests_info()
            self.observe_loras(engine.config.max_loras, running, waiting)

    def observe_loras(self, max_lora: int, running: list[str], waiting: list[str]) -> None:
        labels = (str(max_lora), ",".join(waiting), ",".join(running))
        if labels != self._lora_labels:
            self.lora_info.clear()
            self.lora_info.labels(*labels).set(time.time())
            self._lora_labels = labels

    def request_aborted(self, request_id: str) -> None:
        self.request_finished(request_id, "abort")

    # ---- HTTP side ---------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
