"""`LLM.get_metrics()`: the engine's figures as vLLM's metric reader objects (`Counter`, `Gauge`; `Vector` and `Histogram` for isinstance checks,
from `vllm.v1.metrics.reader`), under the Prometheus names the server exports."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.engine.stats import EngineStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """vLLM's per-position counters (vllm:spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int] = field(default_factory=list)


@dataclass
class Histogram(Metric):
    """vLLM's histogram reader; no kvserve figure is one yet (isinstance checks work)."""

    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)


def metrics_of(stats: EngineStats, model_name: str) -> list[Metric]:
    labels = {"model_name": model_name}
    gauges = {"vllm:num_requests_running": stats.num_running,
              "vllm:num_requests_waiting": stats.num_waiting,
              "vllm:kv_cache_usage_perc": stats.kv_cache_usage,
              "vllm:gpu_cache_usage_perc": stats.kv_cache_usage}
    counters = {"vllm:prefix_cache_queries": stats.prefix_cache_queries,
                "vllm:prefix_cache_hits": stats.prefix_cache_hits,
                "vllm:external_prefix_cache_queries": stats.external_prefix_cache_queries,
                "vllm:external_prefix_cache_hits": stats.external_prefix_cache_hits,
                "vllm:num_preemptions": stats.num_preemptions,
                "vllm:prompt_tokens": stats.prompt_tokens,
                "vllm:generation_tokens": stats.generation_tokens}
    out: list[Metric] = [Gauge(n, dict(labels), float(v)) for n, v in gauges.items()]
    out += [Counter(n, dict(labels), int(v)) for n, v in counters.items()]
    return out + _spec_metrics(stats, labels)


def _spec_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    """Speculative decoding's counters, present when any draft was scored (as vLLM's, which
    registers them only with a speculative_config)."""
    if not getattr(stats, "spec_decode_num_drafts", 0):
        return []
    counters = {"vllm:spec_decode_num_drafts": stats.spec_decode_num_drafts,
                "vllm:spec_decode_num_draft_tokens": stats.spec_decode_num_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": stats.spec_decode_num_accepted_tokens}
    return [Counter(n, dict(labels), int(v)) for n, v in counters.items()] + [
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
               list(stats.spec_decode_accepted_per_pos))]
